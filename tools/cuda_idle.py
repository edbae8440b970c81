#!/usr/bin/env python3
"""How much of each engine step the GPU sits idle, from the CSV that
tools/cuda_trace.c (CUPTI, loaded with CUDA_INJECTION64_PATH) writes:

    python3 tools/cuda_idle.py /tmp/t.csv --skip 5 [--last N] [--min-period-ms X] [--json out.json]

The engine's forward begins every step with the rope_table kernel, so a step
runs from the start of one kernel whose name contains "rope_table" to the
start of the next (the last one, having no successor, ends no step). For each
step: period = next_start - start; busy = the length of the union of all
kernel, memcpy and memset intervals clipped to [start, next_start), so work on
overlapping streams counts once and work straddling a boundary is split
between the two steps; idle share = 1 - busy / period. A step's input upload
(a memcpy enqueued before its rope_table) falls in the step before it.

Steps are taken in order: --skip drops the first N (warm-up, prefill), then
--min-period-ms drops short ones, then --last keeps the last N of the rest.
Steps are also grouped by whether their rope_table ran inside a CUDA graph
(graph_id != 0) or eagerly. Standard library only.
"""
import argparse
import bisect
import csv
import json
import statistics
import sys


def read_trace(path):
    """The records of a trace as (kind, start_ns, end_ns, stream, graph_id, name) tuples."""
    out = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0] == "kind":
                continue
            if len(row) < 6:
                raise ValueError(f"{path}: short line {row!r}")
            out.append((row[0], int(row[1]), int(row[2]), int(row[3]), int(row[4]), ",".join(row[5:])))
    return out


def merge(intervals):
    """The union of (start, end) intervals as sorted, disjoint lists of starts and ends."""
    starts, ends = [], []
    for a, b in sorted(intervals):
        if ends and a <= ends[-1]:
            if b > ends[-1]:
                ends[-1] = b
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def covered(starts, ends, prefix, lo, hi):
    """Length of [lo, hi) covered by the merged intervals; prefix[i] = total length of the first i."""
    if hi <= lo:
        return 0
    i = bisect.bisect_right(ends, lo)        # first interval ending after lo
    j = bisect.bisect_left(starts, hi)       # intervals [i, j) start before hi
    if i >= j:
        return 0
    total = prefix[j] - prefix[i]
    total -= max(0, lo - starts[i])          # clip the first at lo
    total -= max(0, ends[j - 1] - hi)        # and the last at hi
    return total


def steps_of(records, marker="rope_table"):
    """Every step as a dict (start, end, period, busy ns, graph flag) in time order."""
    marks = sorted((r[1], r[4]) for r in records if r[0] == "kernel" and marker in r[5])
    starts, ends = merge((r[1], r[2]) for r in records)
    prefix = [0]
    for a, b in zip(starts, ends):
        prefix.append(prefix[-1] + b - a)
    steps = []
    for (s, graph_id), (e, _) in zip(marks, marks[1:]):
        steps.append({"start": s, "end": e, "period": e - s,
                      "busy": covered(starts, ends, prefix, s, e), "graph": graph_id != 0})
    return steps


def select(steps, skip=0, last=None, min_period_ms=None):
    steps = steps[skip:]
    if min_period_ms is not None:
        steps = [s for s in steps if s["period"] >= min_period_ms * 1e6]
    if last is not None:
        steps = steps[-last:] if last > 0 else []
    return steps


def idle_share(s):
    return 1.0 - s["busy"] / s["period"] if s["period"] > 0 else 0.0


def summarize(steps):
    """Medians and means over steps (times in ms), plus the per-step lists."""
    if not steps:
        return {"steps": 0}
    periods = [s["period"] / 1e6 for s in steps]
    busy = [s["busy"] / 1e6 for s in steps]
    idle = [idle_share(s) for s in steps]
    return {
        "steps": len(steps),
        "median_period_ms": statistics.median(periods),
        "median_busy_ms": statistics.median(busy),
        "median_idle_share": statistics.median(idle),
        "mean_idle_share": statistics.fmean(idle),
        "periods_ms": periods,
        "busy_ms": busy,
        "idle_shares": idle,
    }


def top_kernels(records, steps, n=15):
    """The n names with the most GPU time among records starting inside the steps:
    (name, count, total ns); memcpy and memset named by kind, e.g. "memcpy HtoD"."""
    bounds = [(s["start"], s["end"]) for s in steps]
    lows = [b[0] for b in bounds]
    agg = {}
    for kind, a, b, _, _, name in records:
        i = bisect.bisect_right(lows, a) - 1
        if i < 0 or a >= bounds[i][1]:
            continue
        key = name if kind == "kernel" else f"{kind} {name}" if kind == "memcpy" else kind
        c = agg.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += b - a
    rows = sorted(((k, c, t) for k, (c, t) in agg.items()), key=lambda r: -r[2])
    return rows[:n]


def print_summary(label, sm):
    if not sm["steps"]:
        print(f"{label}: no steps")
        return
    print(f"{label}: {sm['steps']} steps, median period {sm['median_period_ms']:.3f} ms, "
          f"median busy {sm['median_busy_ms']:.3f} ms, idle share median {sm['median_idle_share']:.3f} "
          f"mean {sm['mean_idle_share']:.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="CSV written by libcas_cuda_trace.so")
    ap.add_argument("--skip", type=int, default=0, help="drop the first N steps")
    ap.add_argument("--last", type=int, default=None, help="keep only the last N steps")
    ap.add_argument("--min-period-ms", type=float, default=None, help="drop steps shorter than this")
    ap.add_argument("--marker", default="rope_table", help="substring of the step's first kernel")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args(argv)

    records = read_trace(args.trace)
    all_steps = steps_of(records, args.marker)
    steps = select(all_steps, args.skip, args.last, args.min_period_ms)
    print(f"{args.trace}: {len(records)} records, {len(all_steps)} steps found, {len(steps)} kept")
    sm = summarize(steps)
    print_summary("all", sm)
    groups = {}
    for name, want in (("graph", True), ("eager", False)):
        g = [s for s in steps if s["graph"] == want]
        if g:
            groups[name] = summarize(g)
    if len(groups) > 1:
        for name, g in groups.items():
            print_summary(name, g)

    top = top_kernels(records, steps) if steps else []
    busy_total = sum(s["busy"] for s in steps)
    if top:
        print(f"\n{'name':60} {'count':>8} {'total ms':>10} {'mean us':>9} {'of busy':>8}")
        for name, count, total in top:
            share = total / busy_total if busy_total else 0.0
            print(f"{name[:60]:60} {count:8d} {total / 1e6:10.3f} {total / count / 1e3:9.2f} {share:8.3f}")

    if args.json:
        out = dict(sm)
        out["trace"] = args.trace
        out["skip"] = args.skip
        out["last"] = args.last
        out["min_period_ms"] = args.min_period_ms
        out["groups"] = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)} for k, v in groups.items()}
        out["top"] = [{"name": n, "count": c, "total_ms": t / 1e6, "mean_us": t / c / 1e3,
                       "share_of_busy": t / busy_total if busy_total else 0.0} for n, c, t in top]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if steps else 1


if __name__ == "__main__":
    sys.exit(main())
