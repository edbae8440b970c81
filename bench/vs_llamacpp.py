#!/usr/bin/env python3
"""Collects bench/vs_llamacpp.sh's runs into one JSON and a plot.

For each file: cascade's bench/model_bench numbers and llama.cpp's (llama-bench
pp256 and tg64 at depth 256, llama-batched-bench 32 x (64 + 64)), each the best
over the rounds (llama.cpp: its best repetition of its better flash-attention
setting), the ratios against the issue's targets, and the ceilings measured in
the same runs (read bandwidth, and the single-stream decode roofline it gives).
"""
import argparse
import collections
import json
import os
import platform
import statistics

TARGETS = {"prefill": 1.5, "decode": 1.5, "decode_32": 4.0}


def cpu_facts():
    model, flags = "", set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_tile"]
    return {"cpu": model, "logical_cpus": os.cpu_count(), "kernel": platform.release(),
            "isa": [f for f in wanted if f in flags]}


def tensor_types(path):
    try:
        import gguf
    except ImportError:
        return None
    r = gguf.GGUFReader(path)
    return dict(sorted(collections.Counter(t.tensor_type.name.lower() for t in r.tensors).items()))


def llama_bench_rounds(paths, key):
    """per round and flash-attention setting: the best repetition (tokens/s)"""
    out = []
    for p in paths:
        best = {}
        for e in json.load(open(p)):
            if (key == "pp" and e["n_prompt"] > 0) or (key == "tg" and e["n_gen"] > 0):
                fa = "on" if e["flash_attn"] in (1, True, "1", "on") else "off"
                best[fa] = max(best.get(fa, 0.0), max(e.get("samples_ts") or [e["avg_ts"]]))
        out.append(best)
    return out


def batched_rounds(paths_by_fa, key):
    """per round and flash-attention setting: llama-batched-bench's tokens/s"""
    rounds = len(next(iter(paths_by_fa.values())))
    out = [{} for _ in range(rounds)]
    for fa, paths in paths_by_fa.items():
        for r, p in enumerate(paths):
            for line in open(p):
                out[r][fa] = json.loads(line)["speed_tg" if key == "decode" else "speed_pp"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--types", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--llama-commit", required=True)
    ap.add_argument("--sdist", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    d, R = a.dir, range(1, a.rounds + 1)
    rows = []
    for t in a.types.split():
        cas = [json.load(open(f"{d}/cascade-{t}-{r}.json")) for r in R]
        bb_paths = {fa: [f"{d}/bb-{fa}-{t}-{r}.jsonl" for r in R] for fa in ("off", "on")}
        # per round: cascade's number, and llama.cpp's under its better flash-attention setting
        lfa = {"prefill": llama_bench_rounds([f"{d}/lb-pp-{t}-{r}.json" for r in R], "pp"),
               "decode": llama_bench_rounds([f"{d}/lb-tg-{t}-{r}.json" for r in R], "tg"),
               "prefill_32": batched_rounds(bb_paths, "prefill"), "decode_32": batched_rounds(bb_paths, "decode")}
        per = {"cascade": {"prefill": [x["single"]["prefill_tokens_per_s"] for x in cas],
                           "decode": [x["single"]["decode_tokens_per_s"] for x in cas],
                           "prefill_32": [x["batch"]["prefill_tokens_per_s"] for x in cas],
                           "decode_32": [x["batch"]["decode_tokens_per_s"] for x in cas]},
               "llama_cpp": {k: [max(v.values()) for v in lfa[k]] for k in lfa}}
        c = {k: max(v) for k, v in per["cascade"].items()}
        lc = {k: max(v) for k, v in per["llama_cpp"].items()}
        med = {k: round(statistics.median(per["cascade"][k]) / statistics.median(per["llama_cpp"][k]), 2) for k in c}
        bw = [x["read_bandwidth_gbs"] for x in cas] + [x["read_bandwidth_after_gbs"] for x in cas]
        wb = cas[0]["weight_bytes_per_token"]
        ratio = {k: round(c[k] / lc[k], 2) for k in c}
        rows.append({
            "type": t, "file": cas[0]["model"], "file_bytes": os.path.getsize(cas[0]["model"]),
            "tensor_types": tensor_types(cas[0]["model"]),
            "cascade": {k: round(v, 1) for k, v in c.items()},
            "llama_cpp": {k: round(v, 1) for k, v in lc.items()},
            "ratio": ratio,
            "ratio_of_medians": med,
            "per_round": {side: {k: [round(x, 1) for x in v] for k, v in d2.items()} for side, d2 in per.items()},
            "llama_cpp_by_flash_attn_per_round": {k: [{fa: round(x, 1) for fa, x in v.items()} for v in lfa[k]]
                                                  for k in lfa},
            "targets_met": {k: ratio[k] >= v for k, v in TARGETS.items()},
            "ceiling": {"read_bandwidth_gbs_min": min(bw), "read_bandwidth_gbs_max": max(bw),
                        "weight_bytes_per_token": wb,
                        "decode_roofline_tokens_per_s": round(max(bw) * 1e9 / wb, 1),
                        "cascade_decode_fraction": round(c["decode"] / (max(bw) * 1e9 / wb), 3),
                        "llama_cpp_decode_fraction": round(lc["decode"] / (max(bw) * 1e9 / wb), 3)},
            "cascade_simd": {"matvec": cas[0]["simd"], "batched": cas[0]["batch_simd"]},
        })
    out = {
        "what": "cascade (bench/model_bench.c) beside llama.cpp's llama-bench and llama-batched-bench on the same "
                "GGUF files, threads and machine, alternating, ROUNDS rounds; cascade/llama_cpp/ratio: the best "
                "round of each side (a neighbour on the shared VM only slows a run down), ratio_of_medians: the "
                "median rounds'",
        "machine": cpu_facts(), "threads": a.threads, "rounds": a.rounds,
        "llama_cpp": {"commit": a.llama_commit, "source": a.sdist + " (vendor/llama.cpp)",
                      "build": "cmake -DCMAKE_BUILD_TYPE=Release (GGML_NATIVE on, OpenMP)",
                      "prefill": "llama-bench -p 256 -n 0 -fa 0,1 -r 3", "decode": "llama-bench -p 0 -n 64 -d 256 -fa 0,1 -r 3",
                      "batched": "llama-batched-bench -c 4096 -b 2048 -ub 512 -npp 64 -ntg 64 -npl 32 -fa off|on"},
        "cascade": {"prefill": "256-token prompt, one sequence", "decode": "64 steps after the 256-token prompt",
                    "batched": "32 sequences of 64 prompt tokens, 64 decode steps", "kv": "f16"},
        "targets": {"prefill_ratio": TARGETS["prefill"], "decode_ratio": TARGETS["decode"],
                    "decode_32_ratio": TARGETS["decode_32"]},
        "files": rows,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for r in rows:
        print(f"{r['type']:7s} prefill {r['cascade']['prefill']:7.0f} vs {r['llama_cpp']['prefill']:7.0f} "
              f"({r['ratio']['prefill']:.2f}x)  decode {r['cascade']['decode']:6.1f} vs {r['llama_cpp']['decode']:6.1f} "
              f"({r['ratio']['decode']:.2f}x)  32-seq decode {r['cascade']['decode_32']:7.0f} vs "
              f"{r['llama_cpp']['decode_32']:6.0f} ({r['ratio']['decode_32']:.2f}x)  medians: "
              f"{r['ratio_of_medians']['prefill']:.2f}x {r['ratio_of_medians']['decode']:.2f}x "
              f"{r['ratio_of_medians']['decode_32']:.2f}x")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axs = plt.subplots(1, 3, figsize=(13, 4))
    names = [r["type"] for r in rows]
    for ax, key, title in zip(axs, ("prefill", "decode", "decode_32"),
                              ("prompt processing (256 tokens)", "single-stream decode", "32 sequences' decode")):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["cascade"][key] for r in rows], 0.4, label="cascade")
        ax.bar([x + 0.2 for x in xs], [r["llama_cpp"][key] for r in rows], 0.4, label="llama.cpp")
        for x, r in zip(xs, rows):
            ax.text(x, max(r["cascade"][key], r["llama_cpp"][key]) * 1.02, f"{r['ratio'][key]:.2f}x",
                    ha="center", fontsize=8)
        if key == "decode":
            roof = [r["ceiling"]["decode_roofline_tokens_per_s"] for r in rows]
            ax.scatter(list(xs), roof, marker="_", s=400, color="k", label="roofline (read bandwidth)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.set_ylim(0, 1.12 * max(max(r["cascade"][key], r["llama_cpp"][key], r["ceiling"]["decode_roofline_tokens_per_s"]
                                      if key == "decode" else 0) for r in rows))
        ax.set_title(f"{title}, target {TARGETS[key]}x", fontsize=9)
        ax.set_ylabel("tokens/s")
    handles, labels = axs[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    m = out["machine"]
    fig.suptitle(f"SmolLM2-135M, {a.threads} threads, {m['cpu']} ({m['logical_cpus']} vCPU); "
                 f"llama.cpp {a.llama_commit[:7]}", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(a.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
