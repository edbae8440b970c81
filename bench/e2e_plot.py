#!/usr/bin/env python3
"""Plots of the end-to-end workloads (bench/cuda/e2e_bench.sh).

Reads DIR/e2e.jsonl (one `cascade bench --json` line per run, with "mode"
added, or {"workload", "mode", "error"}) and each run's
DIR/steps-WORKLOAD-MODE.json and DIR/latency-WORKLOAD-MODE.json. For every
workload writes DIR/e2e-WORKLOAD.png with four panels:
  (a) output throughput per mode (bars; a failed run is marked),
  (b) each decode step's time over the run, with its byte roofline (the
      weights plus the step's distinct KV tokens, read once at the copy
      bandwidth) as a dashed line of the same colour,
  (c) the CDF of time to first token per mode,
  (d) the CDF of inter-token latency per mode,
and prints a markdown table of all runs to stdout. Missing runs or files
leave their panel (or its line) out. Where e2e.jsonl holds several lines for
one workload and mode, the last one counts.

Usage: python3 bench/e2e_plot.py [DIR] [--png-dir DIR2]   (DIR: $OUT or /tmp/out)
"""
import argparse
import json
import os
import sys
import textwrap

MODES = ["cascade", "prefix", "none"]
COLORS = {"cascade": "tab:blue", "prefix": "tab:orange", "none": "tab:gray"}
MODE_TEXT = {"cascade": "cascade + prefix cache", "prefix": "prefix cache only", "none": "neither"}


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_runs(path):
    runs = {}
    order = []
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return runs, order
    for ln in lines:
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        w = r.get("workload") or r.get("tree") or "?"
        m = r.get("mode") or r.get("label") or mode_of(r)
        if w not in order:
            order.append(w)
        runs[(w, m)] = r
    return runs, order


def mode_of(r):
    """The mode from the engine flags, for lines without a mode."""
    c, p = r.get("cascade"), r.get("prefix_cache")
    if c == 1 and p == 1:
        return "cascade"
    if c == 0 and p == 1:
        return "prefix"
    if c == 0 and p == 0:
        return "none"
    return f"cascade={c},prefix_cache={p}"


def cdf(ax, values, label, color):
    v = sorted(x for x in values if x is not None)
    if not v:
        return False
    n = len(v)
    ax.step(v, [(i + 1) / n for i in range(n)], where="post", label=label, color=color)
    return True


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def plot_workload(plt, d, w, runs, modes, png_dir):
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (a_tp, a_steps), (a_ttft, a_itl) = axes
    any_run = [runs.get((w, m)) for m in modes]
    first = next((r for r in any_run if r and "error" not in r), None)
    title = f"{w}"
    if first:
        title += f": {first.get('model')} on {first.get('device')}, {first.get('requests')} requests, scale {first.get('scale')}"
    fig.suptitle(title)

    # (a) output throughput per mode
    xs, ys, cs, notes = [], [], [], []
    for i, m in enumerate(modes):
        r = runs.get((w, m))
        xs.append(i)
        cs.append(COLORS.get(m, "tab:green"))
        if r and "error" not in r:
            ys.append(r.get("output_tok_per_s") or 0)
            notes.append("")
        else:
            ys.append(0)
            notes.append("failed" if r else "no run")
    bars = a_tp.bar(xs, ys, color=cs)
    for b, y, n in zip(bars, ys, notes):
        a_tp.annotate(n or f"{y:.0f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=9)
    a_tp.set_xticks(xs)
    a_tp.set_xticklabels([textwrap.fill(MODE_TEXT.get(m, m), 14) for m in modes], fontsize=9)
    a_tp.set_ylabel("output tokens/s")
    a_tp.set_title("(a) output throughput")

    # (b) decode steps over the run, with the roofline
    drawn = False
    roof_drawn = False
    for m in modes:
        r = runs.get((w, m))
        s = load_json(os.path.join(d, f"steps-{w}-{m}.json"))
        if not s or not s.get("steps"):
            continue
        dec = [x for x in s["steps"] if x.get("decode")]
        if not dec:
            continue
        color = COLORS.get(m, "tab:green")
        a_steps.plot([x["t"] for x in dec], [x["s"] * 1e3 for x in dec], ".", ms=3, color=color,
                     label=f"{MODE_TEXT.get(m, m)}: step")
        drawn = True
        gbps = s.get("copy_gbps") or (r or {}).get("copy_gbps")
        if gbps and s.get("weight_bytes"):
            a_steps.plot([x["t"] for x in dec], [x["bytes"] / (gbps * 1e9) * 1e3 for x in dec], "--", lw=1,
                         color=color, label=f"{MODE_TEXT.get(m, m)}: roofline")
            roof_drawn = True
    a_steps.set_xlabel("time since the first request (s)")
    a_steps.set_ylabel("decode step (ms)")
    a_steps.set_title("(b) decode steps" + ("" if roof_drawn else " (no copy bandwidth: no roofline)"))
    if drawn:
        a_steps.set_yscale("log")
        a_steps.legend(fontsize=8)

    # (c), (d) latency CDFs
    for ax, key, name in ((a_ttft, "ttft_ms", "(c) time to first token"), (a_itl, "itl_ms", "(d) inter-token latency")):
        got = False
        for m in modes:
            lat = load_json(os.path.join(d, f"latency-{w}-{m}.json"))
            if lat and cdf(ax, lat.get(key) or [], MODE_TEXT.get(m, m), COLORS.get(m, "tab:green")):
                got = True
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_title(name)
        if got:
            ax.set_xscale("log")
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(png_dir, f"e2e-{w}.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def table(runs, order, modes):
    cols = ["workload", "mode", "out tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "decode step p50 ms", "p99 ms", "batch p50", "roofline ms", "step/roofline", "prompt computed",
            "steps (cascade)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    seen_modes = modes + sorted({m for (_, m) in runs} - set(modes))
    for w in order:
        for m in seen_modes:
            r = runs.get((w, m))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {w} | {m} | error: {r['error']} |" + " |" * (len(cols) - 3))
                continue
            lines.append("| " + " | ".join([
                w, m, fmt(r.get("output_tok_per_s"), ".1f"), fmt(r.get("total_tok_per_s"), ".0f"),
                fmt(r.get("ttft_ms_p50"), ".1f"), fmt(r.get("ttft_ms_p99"), ".1f"),
                fmt(r.get("itl_ms_p50"), ".2f"), fmt(r.get("itl_ms_p99"), ".2f"),
                fmt(r.get("decode_step_ms_p50"), ".3f"), fmt(r.get("decode_step_ms_p99"), ".3f"),
                fmt(r.get("decode_batch_median"), ".0f"), fmt(r.get("roofline_ms_median"), ".3f"),
                fmt(r.get("step_over_roofline"), ".2f"),
                f"{r.get('prompt_tokens_computed')}/{r.get('prompt_tokens')}",
                f"{r.get('steps')} ({r.get('cascade_steps')})"]) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--png-dir", help="where the PNGs go (default: DIR)")
    a = ap.parse_args()
    runs, order = load_runs(os.path.join(a.dir, "e2e.jsonl"))
    if not runs:
        sys.exit(f"e2e_plot: no runs in {os.path.join(a.dir, 'e2e.jsonl')}")
    modes = MODES + sorted({m for (_, m) in runs} - set(MODES))
    print(table(runs, order, modes))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("e2e_plot: no matplotlib, no plots", file=sys.stderr)
        return
    png_dir = a.png_dir or a.dir
    os.makedirs(png_dir, exist_ok=True)
    for w in order:
        ms = [m for m in modes if (w, m) in runs]
        print(f"wrote {plot_workload(plt, a.dir, w, runs, ms, png_dir)}", file=sys.stderr)


if __name__ == "__main__":
    main()
