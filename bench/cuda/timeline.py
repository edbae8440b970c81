#!/usr/bin/env python3
"""Summarise the many-rows kernel's timeline (CASCADE_CUDA_XV=18).

The kernel writes, per CTA, its SM, the global timer and SM clock at its start
and end, and per task SM clock stamps of each warpgroup's thread 0 (see
cas_tl in src/cuda/cuda_attn_wgmma.cu); the bench dumps them at exit to the
file CASCADE_CUDA_TRACE names. This script puts every stamp on one time axis
(the global timer at the CTA's start plus its clocks at the CTA's own rate),
classes tasks as shared (a pass of several row blocks) or tail (a pass read
by one CTA), and prints where the run's time goes: per class the task time,
the first-tile latency and the waits for full stages and for the turn; when
the CTAs finish their shared tasks and their last task; how many CTAs run a
tail and how many a shared task over time. With --png it also draws the
timeline (one row per CTA) and the concurrency.

usage: timeline.py TRACE.json [--png out.png] [--json out.json] [--label text]
"""
import argparse
import json
import statistics
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    ctas = []
    for c in d["ctas"]:
        sm, gt0, clk0, gt1, clk1, ntask, gtp, clkp = c["hdr"]
        if gt1 <= gt0 or clk1 <= clk0:
            continue
        f = (clk1 - clk0) / (gt1 - gt0)  # clocks per ns
        def at(clk, gt0=gt0, clk0=clk0, f=f):
            return gt0 + (clk - clk0) / f if clk else None
        tasks = []
        for e in c["tasks"]:
            meta = e[9]
            t = {
                "rows": meta & 0xFFFF, "tiles": (meta >> 16) & 0xFFFF, "kv_head": (meta >> 32) & 0xFFFF,
                "once": (meta >> 48) & 1,
                "c0_start": at(e[0]), "c0_first": at(e[1]), "c0_end": at(e[2]),
                "c0_full_ns": e[3] / f, "c0_turn_ns": e[4] / f,
                "c1_start": at(e[5]), "c1_end": at(e[6]),
                "p_first": at(e[7]), "p_last": at(e[8]), "c1_full_ns": e[10] / f,
            }
            # a task of at most 64 rows runs on consumer 0; consumer 1 only
            # keeps the protocol (its stamps are the task's otherwise too)
            t["start"] = t["c0_start"] if t["c0_start"] is not None else t["c1_start"]
            ends = [x for x in (t["c0_end"], t["c1_end"]) if x is not None]
            t["end"] = max(ends) if ends else None
            t["cls"] = "tail" if t["once"] and t["rows"] <= 16 else ("once" if t["once"] else "shared")
            tasks.append(t)
        ctas.append({"cta": c["cta"], "sm": sm, "ghz": f, "start": gt0, "c0_end": gt1, "p_end": gtp, "tasks": tasks})
    if not ctas:
        sys.exit("no CTA with a complete header in " + path)
    t0 = min(c["start"] for c in ctas)
    for c in ctas:  # ns since the first CTA's start
        for k in ("start", "c0_end", "p_end"):
            c[k] = (c[k] - t0) if c[k] else None
        for t in c["tasks"]:
            for k in ("c0_start", "c0_first", "c0_end", "c1_start", "c1_end", "p_first", "p_last", "start", "end"):
                if t[k] is not None:
                    t[k] -= t0
    return ctas


def q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def summary(ctas):
    us = 1e-3
    out = {}
    end = max(c["c0_end"] for c in ctas)
    out["ctas"] = len(ctas)
    out["span_us"] = end * us
    out["cta_start_us"] = [q([c["start"] * us for c in ctas], p) for p in (0, 0.5, 1)]
    out["cta_end_us"] = [q([c["c0_end"] * us for c in ctas], p) for p in (0, 0.5, 1)]
    out["sm_ghz_median"] = statistics.median(c["ghz"] for c in ctas)
    cls = {}
    for c in ctas:
        for t in c["tasks"]:
            if t["start"] is None or t["end"] is None or t["tiles"] == 0:
                continue
            s = cls.setdefault(t["cls"], {"n": 0, "tiles": 0, "busy_ns": 0.0, "first_ns": [], "full_ns": 0.0,
                                          "turn_ns": 0.0, "per_tile_ns": [], "lead_ns": []})
            dur = t["end"] - t["start"]
            s["n"] += 1
            s["tiles"] += t["tiles"]
            s["busy_ns"] += dur
            s["per_tile_ns"].append(dur / t["tiles"])
            if t["c0_first"] is not None and t["c0_start"] is not None:
                s["first_ns"].append(t["c0_first"] - t["c0_start"])
            s["full_ns"] += t["c0_full_ns"]
            s["turn_ns"] += t["c0_turn_ns"]
            if t["p_first"] is not None:
                s["lead_ns"].append(t["start"] - t["p_first"])
    for k, s in cls.items():
        cls[k] = {
            "tasks": s["n"], "tiles": s["tiles"],
            "cta_us_sum": s["busy_ns"] * us,
            "per_tile_us_median": q(s["per_tile_ns"], 0.5) * us,
            "per_tile_us_p10_p90": [q(s["per_tile_ns"], 0.1) * us, q(s["per_tile_ns"], 0.9) * us],
            "first_tile_us_median": q(s["first_ns"], 0.5) * us,
            "full_wait_share": s["full_ns"] / s["busy_ns"] if s["busy_ns"] else 0.0,
            "turn_wait_share": s["turn_ns"] / s["busy_ns"] if s["busy_ns"] else 0.0,
            "producer_lead_us_median": q(s["lead_ns"], 0.5) * us,
        }
    out["classes"] = cls
    # gaps: a CTA's time not inside any of its tasks (start-up, between tasks, the end)
    gaps = []
    for c in ctas:
        iv = sorted((t["start"], t["end"]) for t in c["tasks"] if t["start"] is not None and t["end"] is not None)
        busy, cur = 0.0, None
        for a, b in iv:
            if cur is None or a > cur[1]:
                if cur:
                    busy += cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        if cur:
            busy += cur[1] - cur[0]
        gaps.append((c["c0_end"] - c["start"] - busy) * us)
    out["cta_idle_us"] = [q(gaps, p) for p in (0, 0.5, 1)]
    last_shared = [max((t["end"] for t in c["tasks"] if t["cls"] == "shared" and t["end"] is not None), default=None)
                   for c in ctas]
    ls = [x * us for x in last_shared if x is not None]
    out["last_shared_end_us"] = [q(ls, p) for p in (0, 0.5, 1)] if ls else None
    # concurrency: CTAs in a shared / tail task per time bin
    nb = 50
    bins = [{"shared": 0.0, "tail": 0.0, "once": 0.0} for _ in range(nb)]
    w = end / nb
    for c in ctas:
        for t in c["tasks"]:
            if t["start"] is None or t["end"] is None:
                continue
            for i in range(int(t["start"] // w), min(nb, int(t["end"] // w) + 1)):
                lo, hi = max(t["start"], i * w), min(t["end"], (i + 1) * w)
                if hi > lo:
                    bins[i][t["cls"]] += (hi - lo) / w
    out["concurrency"] = [{"t_us": (i + 0.5) * w * us, **{k: round(v, 1) for k, v in b.items()}}
                          for i, b in enumerate(bins)]
    return out


def show(out, label):
    print("timeline %s: %d CTAs, span %.1f us (SM clock %.2f GHz median)" % (label, out["ctas"], out["span_us"],
                                                                             out["sm_ghz_median"]))
    print("  CTA start min/median/max %.1f / %.1f / %.1f us, end %.1f / %.1f / %.1f us, idle %.1f / %.1f / %.1f us"
          % tuple(out["cta_start_us"] + out["cta_end_us"] + out["cta_idle_us"]))
    if out["last_shared_end_us"]:
        print("  last shared task ends min/median/max %.1f / %.1f / %.1f us" % tuple(out["last_shared_end_us"]))
    for k, s in sorted(out["classes"].items()):
        print("  %-6s %4d tasks %5d tiles, %8.1f CTA-us; per tile %.3f us (p10 %.3f, p90 %.3f), first tile %.2f us, "
              "full waits %.0f%%, turn waits %.0f%%, producer lead %.2f us"
              % (k, s["tasks"], s["tiles"], s["cta_us_sum"], s["per_tile_us_median"], s["per_tile_us_p10_p90"][0],
                 s["per_tile_us_p10_p90"][1], s["first_tile_us_median"], 100 * s["full_wait_share"],
                 100 * s["turn_wait_share"], s["producer_lead_us_median"]))
    cc = out["concurrency"]
    step = max(1, len(cc) // 10)
    print("  CTAs in shared / tail tasks over time: " +
          ", ".join("%.0fus %.0f/%.0f" % (b["t_us"], b["shared"], b["tail"] + b["once"]) for b in cc[::step]))


def plot(ctas, out, path, label):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    col = {"shared": "tab:blue", "tail": "tab:orange", "once": "tab:green"}
    for y, c in enumerate(sorted(ctas, key=lambda c: c["cta"])):
        for t in c["tasks"]:
            if t["start"] is None or t["end"] is None:
                continue
            a.barh(y, (t["end"] - t["start"]) / 1e3, left=t["start"] / 1e3, height=0.8, color=col[t["cls"]],
                   edgecolor="none")
    a.set_ylabel("CTA")
    a.set_title("many-rows kernel timeline %s (blue: shared-pass tasks, orange: decode tails)" % label)
    ts = [x["t_us"] for x in out["concurrency"]]
    b.plot(ts, [x["shared"] for x in out["concurrency"]], label="CTAs in shared tasks", color="tab:blue")
    b.plot(ts, [x["tail"] + x["once"] for x in out["concurrency"]], label="CTAs in tails", color="tab:orange")
    b.set_xlabel("us since the first CTA started")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--png")
    ap.add_argument("--json")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    ctas = load(a.trace)
    out = summary(ctas)
    show(out, a.label)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.png:
        try:
            plot(ctas, out, a.png, a.label)
        except ImportError as e:
            print("no plot: %s" % e)


if __name__ == "__main__":
    main()
