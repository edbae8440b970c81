#!/usr/bin/env python3
"""Engine benchmark: the effect of cascade attention and prefix caching.

Runs `cascade bench` (offline, all requests at once, greedy, fixed output
length) on the default model for a shared-prefix workload with each feature
on and off, for a workload with nothing shared (cascade must cost nothing
there), and for a multi-level tree. Writes bench/results/cpu-engine.json, a
bar chart bench/results/cpu-engine.png, and the table between the
cpu-engine markers in bench/RESULTS.md.

Usage: python3 bench/engine_bench.py [--quick] [--threads N]
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASCADE = os.path.join(ROOT, "build", "cascade")
RESULTS = os.path.join(ROOT, "bench", "results")


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def replace_table(marker, table):
    """Puts table between the <!-- marker --> lines of bench/RESULTS.md, and prints it."""
    path = os.path.join(ROOT, "bench", "RESULTS.md")
    s = open(path).read()
    m0, m1 = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if m0 in s and m1 in s:
        s = s[:s.index(m0) + len(m0)] + "\n" + table + "\n" + s[s.index(m1):]
        open(path, "w").write(s)
    print(table)


def run(name, args, threads):
    cmd = [CASCADE, "bench", "--json", "--threads", str(threads)] + [str(a) for a in args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench failed: {' '.join(cmd)}\n{out.stderr}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["name"], r["args"] = name, " ".join(str(a) for a in args)
    print(f"{name:<34} {r['elapsed_s']:8.2f} s  {r['output_tok_per_s']:8.1f} out tok/s  "
          f"computed {r['prompt_tokens_computed']:6d}/{r['prompt_tokens']:6d}  TTFT p50 {r['ttft_ms_p50']:8.1f} ms  "
          f"TPOT p50 {r['tpot_ms_p50']:7.2f} ms  cascade steps {r['cascade_steps']}/{r['steps']}", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    n, p, s, o = (16, 512, 32, 32) if a.quick else (64, 1024, 32, 64)
    shared = ["--requests", n, "--prefix", p, "--suffix", s, "--output", o]
    unshared = ["--requests", n, "--prefix", 0, "--suffix", p + s, "--output", o]
    runs = [
        run("shared: cascade + prefix cache", shared, a.threads),
        run("shared: prefix cache only", shared + ["--no-cascade"], a.threads),
        run("shared: cascade only", shared + ["--no-prefix-cache"], a.threads),
        run("shared: neither", shared + ["--no-cascade", "--no-prefix-cache"], a.threads),
        run("unshared: cascade on", unshared, a.threads),
        run("unshared: cascade off", unshared + ["--no-cascade"], a.threads),
        run("tree 32*512(16*256)+32*384", ["--tree", "32*512(16*256)+32*384", "--suffix", s, "--output", o], a.threads),
        run("tree, neither", ["--tree", "32*512(16*256)+32*384", "--suffix", s, "--output", o, "--no-cascade",
                              "--no-prefix-cache"], a.threads),
    ]
    by = {r["name"]: r for r in runs}
    summary = {
        "shared_speedup_end_to_end": by["shared: neither"]["elapsed_s"] / by["shared: cascade + prefix cache"]["elapsed_s"],
        "unshared_cascade_slowdown": by["unshared: cascade on"]["elapsed_s"] / by["unshared: cascade off"]["elapsed_s"] - 1,
        "tree_speedup_end_to_end": by["tree, neither"]["elapsed_s"] / by["tree 32*512(16*256)+32*384"]["elapsed_s"],
    }
    cpu = cpu_name()
    doc = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "threads": a.threads}, "model": "SmolLM2-135M-Instruct Q4_1",
           "summary": summary, "runs": runs}
    os.makedirs(RESULTS, exist_ok=True)
    json.dump(doc, open(os.path.join(RESULTS, "cpu-engine.json"), "w"), indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        names = [r["name"] for r in runs]
        ax.barh(names, [r["output_tok_per_s"] for r in runs], color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("output tokens / s (end to end)")
        ax.set_title(f"cascade bench, {n} requests, SmolLM2-135M Q4_1, {a.threads} threads")
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "cpu-engine.png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    lines = [f"Measured on {cpu} ({a.threads} threads), `{n}` requests, output {o} tokens each.", "",
             "| run | elapsed s | output tok/s | prompt tokens computed | prefix-cache hit rate | TTFT p50 ms | TPOT p50 ms | steps with cascade |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['elapsed_s']:.2f} | {r['output_tok_per_s']:.1f} | {r['prompt_tokens_computed']} of "
                     f"{r['prompt_tokens']} | {100 * r['prefix_cache_hit_rate']:.1f}% | {r['ttft_ms_p50']:.1f} | "
                     f"{r['tpot_ms_p50']:.2f} | {r['cascade_steps']}/{r['steps']} |")
    lines += ["", f"Shared prefix, both features against neither: {summary['shared_speedup_end_to_end']:.2f}x end to end; "
              f"nothing shared, cascade on against off: {100 * summary['unshared_cascade_slowdown']:+.1f}% time; "
              f"tree: {summary['tree_speedup_end_to_end']:.2f}x."]
    replace_table("cpu-engine-table", "\n".join(lines))


if __name__ == "__main__":
    main()
