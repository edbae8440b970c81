#!/usr/bin/env python3
"""CPU attention benchmark grid: flat vs cascade through `cascade attn-bench`.

Runs every case, writes bench/results/cpu-attention.json (each case's JSON as
attn-bench printed it, with the bandwidth and FMA ceilings measured in the
same run), draws bench/results/cpu-attention.png (cascade speedup over flat
against the shared prefix length, one line per batch size) and rewrites the
table between the cpu-attention markers in bench/RESULTS.md.

Usage: python3 bench/cpu_attention.py [--quick] [--threads N] [--cascade PATH]
"""
import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASCADE = os.path.join(ROOT, "build", "cascade")
CASCADE_BIN = CASCADE
RESULTS = os.path.join(ROOT, "bench", "results")


def run(args, threads):
    cmd = [CASCADE_BIN, "attn-bench", "--json", "--check", "4", "--threads", str(threads)] + [str(a) for a in args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"attn-bench failed: {' '.join(cmd)}\n{out.stderr}")
    r = json.loads(out.stdout)
    r["args"] = " ".join(str(a) for a in args)
    print(f"{r['args']:<90} flat {r['flat_ms']:9.3f} ms  cascade {r['cascade_ms']:9.3f} ms  "
          f"x{r['speedup']:.2f}  flat {r['flat_GBps']:.1f}/{r['peak_GBps']:.1f} GB/s  "
          f"cascade {r['cascade_GFLOPs']:.1f}/{r['peak_GFLOPs']:.1f} GFLOP/s", flush=True)
    return r


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cascade", default=CASCADE, help="the cascade binary (default build/cascade)")
    a = ap.parse_args()
    global CASCADE_BIN
    CASCADE_BIN = a.cascade
    base = ["--heads", "32:8", "--head-dim", "128", "--page-size", "16", "--qlen", "1", "--repeats", "7"]
    prefixes = [512, 2048, 8192] if not a.quick else [512, 2048]
    batches = [1, 4, 16, 32] if not a.quick else [4, 16]
    grid = []
    for p in prefixes:
        for b in batches:
            grid.append(run(base + ["--batch", b, "--prefix", p, "--suffix", 256, "--dtype", "f32"], a.threads))
    named = {
        "issue_case_f32": base + ["--batch", 32, "--prefix", 8192, "--suffix", 256, "--dtype", "f32"],
        "issue_case_bf16": base + ["--batch", 32, "--prefix", 8192, "--suffix", 256, "--dtype", "bf16"],
        "issue_case_f16": base + ["--batch", 32, "--prefix", 8192, "--suffix", 256, "--dtype", "f16"],
        "issue_case_f32_huge_pages": base + ["--batch", 32, "--prefix", 8192, "--suffix", 256, "--dtype", "f32",
                                             "--huge-pages"],
        "flat_decode_nothing_shared_f32": base + ["--batch", 32, "--prefix", 0, "--suffix", 4096, "--dtype", "f32"],
        "flat_decode_nothing_shared_f32_huge_pages": base + ["--batch", 32, "--prefix", 0, "--suffix", 4096,
                                                             "--dtype", "f32", "--huge-pages"],
        "flat_decode_one_long_f32": base + ["--batch", 1, "--prefix", 0, "--suffix", 65536, "--dtype", "f32"],
        "tree_40_20_10": base + ["--tree", "40*1024(20*512)+10*768", "--suffix", 64, "--dtype", "f32"],
        "prefill_chunk_2048": base[:-4] + ["--qlen", 2048, "--repeats", 3, "--check", 0, "--batch", 1, "--prefix", 0,
                                           "--suffix", 2048, "--dtype", "f32"],
    }
    # bf16 dot products (AMX-BF16 tiles, or vdpbf16ps) where this CPU has them
    probe = subprocess.run([CASCADE_BIN, "attn-bench", "--json", "--batch", "2", "--prefix", "64", "--suffix", "16",
                            "--dtype", "bf16", "--bf16-dot", "--repeats", "1"], capture_output=True, text=True)
    bf16_dot = probe.returncode == 0
    if bf16_dot:
        named["issue_case_bf16_dot"] = base + ["--batch", 32, "--prefix", 8192, "--suffix", 256, "--dtype", "bf16",
                                               "--bf16-dot"]
    if a.quick:
        named = {k: v for k, v in named.items() if k in ("issue_case_f32", "flat_decode_nothing_shared_f32")}
    cases = {k: run(v, a.threads) for k, v in named.items()}
    doc = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": a.threads,
                    "simd": grid[0]["simd"]},
        "note": "each case carries peak_GBps (streaming read) and peak_GFLOPs (f32 FMA) measured in the same run",
        "bf16_dot_available": bf16_dot,
        "grid": grid,
        "cases": cases,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "cpu-attention.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(grid, batches, prefixes)
    table = make_table(doc)
    update_results(table)
    print(table)


def plot(grid, batches, prefixes):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b in batches:
        pts = [(r["prefix"], r["speedup"]) for r in grid if r["batch"] == b]
        ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", label=f"batch {b}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("shared prefix tokens (suffix 256 per request)")
    ax.set_ylabel("cascade speedup over flat")
    ax.set_title("CPU decode attention, 32:8 heads x 128, f32 KV")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "cpu-attention.png"), dpi=120)


def pct(r, rate, peak, variant):
    """share of the ceiling at the median time, and at the best time (the
    ceilings are best-of runs)"""
    med = 100 * r[rate] / r[peak]
    best = r.get(f"{variant}_best_ms")
    if not best:
        return f"{med:.0f}%"
    return f"{med:.0f}%, best {med * r[f'{variant}_ms'] / best:.0f}%"


def make_table(doc):
    m = doc["machine"]
    lines = [f"Measured on {m['cpu']} ({m['cores']} cores, {m['threads']} threads, {m['simd']}); "
             "ceilings measured in the same run.", "",
             "| case | flat ms | cascade ms | speedup | flat GB/s of peak (median, best run) | "
             "cascade GFLOP/s of peak (median, best run) |",
             "| --- | --- | --- | --- | --- | --- |"]
    rows = [(r["args"], r) for r in doc["grid"]] + [(k, r) for k, r in doc["cases"].items()]
    for name, r in rows:
        if name == r.get("args"):
            name = f"B={r['batch']} P={r['prefix']} S={r['suffix']} {r['dtype']}"
        lines.append(f"| {name} | {r['flat_ms']:.3f} | {r['cascade_ms']:.3f} | {r['speedup']:.2f}x | "
                     f"{r['flat_GBps']:.1f} of {r['peak_GBps']:.1f} ({pct(r, 'flat_GBps', 'peak_GBps', 'flat')}) | "
                     f"{r['cascade_GFLOPs']:.1f} of {r['peak_GFLOPs']:.1f} "
                     f"({pct(r, 'cascade_GFLOPs', 'peak_GFLOPs', 'cascade')}) |")
    return "\n".join(lines)


def update_results(table):
    path = os.path.join(ROOT, "bench", "RESULTS.md")
    if not os.path.exists(path):
        return
    s = open(path).read()
    a, b = "<!-- cpu-attention-table -->", "<!-- /cpu-attention-table -->"
    if a in s and b in s:
        s = s[:s.index(a) + len(a)] + "\n" + table + "\n" + s[s.index(b):]
        open(path, "w").write(s)


if __name__ == "__main__":
    main()
