#!/usr/bin/env python3
"""What batch invariance costs on the CPU: the model and engine benchmarks
with it (the default) and without it (--no-batch-invariance), alternated in
one run so that both see the same machine.

Model benchmark (bench/model_bench.c): single-sequence prefill and decode,
32-sequence prefill and decode. Engine benchmark (`cascade bench`, offline,
greedy): a shared system prompt (cascade + prefix cache), nothing shared, a
two-level tree, and one long-context stream (where the batch-invariant plan
cannot split the attention of one sequence along its keys). Each pair runs
`--repeats` times, A then B then A..., and the median is kept.

The matrix kernels are batch-invariant in every build (one reduction order
for every batch size), so the switch measures the attention plans only.
`--baseline-model-bench PATH` adds the model benchmark of another build
(for example one from before the kernels were made batch-invariant) to the
same alternation.

Writes bench/results/cpu-batch-invariance.json and the table between the
cpu-batch-invariance markers of bench/RESULTS.md.

Usage: python3 bench/invariance_bench.py [--threads N] [--repeats R] [--quick]
                                         [--baseline-model-bench PATH]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import cpu_name, replace_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASCADE = os.path.join(ROOT, "build", "cascade")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
RESULTS = os.path.join(ROOT, "bench", "results")
OFF = "--no-batch-invariance"


def model_bench(binary, threads, invariant):
    cmd = [binary, MODEL, str(threads), "32"] + ([] if invariant else [OFF])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="active")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"model_bench failed: {' '.join(cmd)}\n{out.stderr}")
    j = json.loads(out.stdout)
    return {"prefill_1": j["single"]["prefill_tokens_per_s"], "decode_1": j["single"]["decode_tokens_per_s"],
            "prefill_32": j["batch"]["prefill_tokens_per_s"], "decode_32": j["batch"]["decode_tokens_per_s"]}


def engine_bench(args, threads, invariant):
    cmd = [CASCADE, "bench", "--json", "--threads", str(threads)] + [str(a) for a in args] + ([] if invariant else [OFF])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench failed: {' '.join(cmd)}\n{out.stderr}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"output_tok_per_s": r["output_tok_per_s"], "elapsed_s": r["elapsed_s"], "tpot_ms_p50": r["tpot_ms_p50"],
            "ttft_ms_p50": r["ttft_ms_p50"], "cascade_steps": r["cascade_steps"], "steps": r["steps"]}


def median_dicts(ds):
    return {k: statistics.median(d[k] for d in ds) for k in ds[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline-model-bench", default="")
    a = ap.parse_args()
    subprocess.run(["make", "-s", "-C", ROOT, f"-j{os.cpu_count()}", "all"], check=True)
    mb = os.path.join(ROOT, "build", "model_bench")
    subprocess.run(["bash", "-c", f"cd {ROOT} && cc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -o {mb} bench/model_bench.c "
                    "build/libcascade.a $(pkg-config --libs libpcre2-8 libxxhash jansson libmicrohttpd) -lm -lpthread"],
                   check=True)
    n, p, s, o = (16, 512, 32, 32) if a.quick else (64, 1024, 32, 64)
    workloads = [
        ("shared prefix", ["--requests", n, "--prefix", p, "--suffix", s, "--output", o]),
        ("nothing shared", ["--requests", n, "--prefix", 0, "--suffix", p + s, "--output", o]),
        ("tree 32*512(16*256)+32*384", ["--tree", "32*512(16*256)+32*384", "--suffix", s, "--output", o]),
        ("one long stream (4000 + 128)", ["--requests", 1, "--prefix", 0, "--suffix", 4000, "--output", 128]),
    ]
    load0 = os.getloadavg()
    rows = []
    variants = [("invariant", mb, True), ("not invariant", mb, False)]
    if a.baseline_model_bench:
        variants.append(("baseline build", a.baseline_model_bench, True))
    res = {v[0]: [] for v in variants}
    for _ in range(a.repeats):
        for name, binary, inv in variants:
            res[name].append(model_bench(binary, a.threads, inv))
    model = {k: median_dicts(v) for k, v in res.items()}
    for k, v in model.items():
        print(f"model {k:<14} " + "  ".join(f"{m} {x:8.1f}" for m, x in v.items()), flush=True)
    for wname, args in workloads:
        ri, rn = [], []
        for _ in range(a.repeats):
            ri.append(engine_bench(args, a.threads, True))
            rn.append(engine_bench(args, a.threads, False))
        mi, mn = median_dicts(ri), median_dicts(rn)
        rows.append({"workload": wname, "args": " ".join(str(x) for x in args), "invariant": mi, "not_invariant": mn,
                     "cost": mn["output_tok_per_s"] / mi["output_tok_per_s"] - 1})
        print(f"engine {wname:<30} invariant {mi['output_tok_per_s']:8.1f} tok/s  not {mn['output_tok_per_s']:8.1f}"
              f"  cost {100 * rows[-1]['cost']:+.1f}%", flush=True)
    cpu = cpu_name()
    load1 = os.getloadavg()
    doc = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "threads": a.threads,
                       "load_average_1min_start_end": [load0[0], load1[0]]}, "repeats": a.repeats,
           "model": "SmolLM2-135M-Instruct Q4_1", "model_bench": model, "engine_bench": rows,
           "note": "cost = throughput without batch invariance / with it - 1 (positive: invariance is slower); "
                   "medians of alternated runs"}
    os.makedirs(RESULTS, exist_ok=True)
    json.dump(doc, open(os.path.join(RESULTS, "cpu-batch-invariance.json"), "w"), indent=1)
    lines = [f"Measured on {cpu} ({a.threads} threads), medians of {a.repeats} alternated runs, load average "
             f"{load0[0]:.1f} at the start and {load1[0]:.1f} at the end (other jobs shared the machine). Tokens/s; the "
             "cost is how much faster the run is without batch invariance.", "",
             "| model benchmark | " + " | ".join(model) + " | cost |",
             "| --- | " + " | ".join("---" for _ in model) + " | --- |"]
    names = {"prefill_1": "prefill, 1 sequence", "decode_1": "decode, 1 sequence", "prefill_32": "prefill, 32 sequences",
             "decode_32": "decode, 32 sequences"}
    for k, label in names.items():
        cost = model["not invariant"][k] / model["invariant"][k] - 1
        lines.append(f"| {label} | " + " | ".join(f"{model[v][k]:.1f}" for v in model) + f" | {100 * cost:+.1f}% |")
    lines += ["", "| engine benchmark (`cascade bench`) | invariant tok/s | not invariant tok/s | cost | cascade steps |",
              "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['invariant']['output_tok_per_s']:.1f} | "
                     f"{r['not_invariant']['output_tok_per_s']:.1f} | {100 * r['cost']:+.1f}% | "
                     f"{int(r['invariant']['cascade_steps'])} / {int(r['not_invariant']['cascade_steps'])} |")
    replace_table("cpu-batch-invariance-table", "\n".join(lines))


if __name__ == "__main__":
    main()
