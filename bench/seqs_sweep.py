#!/usr/bin/env python3
"""Collects bench/seqs_sweep.sh's runs into one JSON and a plot: per file and
count of sequences decoded together, cascade's decode tokens/s (and the BASE
revision's, where the sweep ran one), llama-batched-bench's (its better flash-
attention setting), each the best over the rounds, every round kept."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_llamacpp import cpu_facts, tensor_types  # noqa: E402


def cascade_rounds(paths):
    """per round: {sequences: decode tokens/s}"""
    out = []
    for p in paths:
        d = json.load(open(p))
        out.append({e["sequences"]: e["decode_tokens_per_s"] for e in d["sweep"]})
    return out


def llama_rounds(d, t, rounds):
    """per round: {sequences: the better flash-attention setting's S_TG tokens/s}"""
    out = []
    for r in range(1, rounds + 1):
        best = {}
        for fa in ("off", "on"):
            for line in open(f"{d}/bb-{fa}-{t}-{r}.jsonl"):
                e = json.loads(line)
                best[e["pl"]] = max(best.get(e["pl"], 0.0), e["speed_tg"])
        out.append(best)
    return out


def best_of(rounds):
    keys = sorted(set().union(*rounds))
    return {k: max(r.get(k, 0.0) for r in rounds) for k in keys}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--types", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--llama-commit", required=True)
    ap.add_argument("--sdist", required=True)
    ap.add_argument("--base", default="")
    ap.add_argument("--cascade-commit", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    R = range(1, a.rounds + 1)
    files = []
    for t in a.types.split():
        cas = cascade_rounds([f"{a.dir}/cascade-{t}-{r}.json" for r in R])
        lla = llama_rounds(a.dir, t, a.rounds)
        path = json.load(open(f"{a.dir}/cascade-{t}-1.json"))["model"]
        entry = {"type": t, "file": path, "tensor_types": tensor_types(path),
                 "cascade": best_of(cas), "llama_cpp": best_of(lla), "rounds": {"cascade": cas, "llama_cpp": lla}}
        if a.base:
            base = cascade_rounds([f"{a.dir}/base-{t}-{r}.json" for r in R])
            entry["cascade_base"] = best_of(base)
            entry["rounds"]["cascade_base"] = base
        entry["ratio"] = {k: round(v / entry["llama_cpp"][k], 2) for k, v in entry["cascade"].items()
                          if entry["llama_cpp"].get(k)}
        files.append(entry)
    out = {"what": "decode tokens/s of N sequences decoded together (64 prompt tokens each, 64 decode steps), "
                   "cascade's bench/model_bench --sweep beside llama.cpp's llama-batched-bench (-npp 64 -ntg 64 "
                   "-npl N, the better of flash attention off and on) on the same GGUF files, threads and machine; "
                   "rounds alternate, each number the best of its rounds",
           "machine": cpu_facts(), "threads": a.threads, "rounds": a.rounds,
           "cascade_commit": a.cascade_commit, "cascade_base": a.base or None,
           "llama_cpp": {"commit": a.llama_commit, "source": a.sdist}, "files": files}
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: plot skipped", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(files), figsize=(5 * len(files), 4), squeeze=False)
    for ax, e in zip(axes[0], files):
        series = [("cascade", e["cascade"], "C0", "-")]
        if "cascade_base" in e:
            series.append((f"cascade {a.base}", e["cascade_base"], "C0", ":"))
        series.append(("llama.cpp", e["llama_cpp"], "C1", "-"))
        for name, d, c, ls in series:
            ks = sorted(int(k) for k in d)
            ax.plot(ks, [d[k] if k in d else d[str(k)] for k in ks], ls, color=c, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences decoded together")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(e["type"])
        ax.grid(alpha=0.3)
        ax.legend()
    m = out["machine"]
    fig.suptitle(f"{m['cpu']}, {a.threads} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
