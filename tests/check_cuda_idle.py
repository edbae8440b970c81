#!/usr/bin/env python3
"""Checks tools/cuda_idle.py (the idle share of GPU steps from a CUPTI trace)
on a synthetic trace with hand-computed answers: four steps between five
rope_table kernels, kernels overlapping on two streams, a memset straddling a
step boundary, a step inside a CUDA graph, a quoted name with a comma, rows
out of time order (as CUPTI delivers buffers). Needs no GPU. Prints "N passed,
N failed" like the C tests.
"""
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "cuda_idle.py")
U = 1000  # the times below are in us; the trace is in ns

ROPE = "_Z17rope_table_kernelPKiPKfPfii"
A, B, C = "_Z8kernel_av", "_Z8kernel_bv", "_Z8kernel_cv"
D = "void foo<a, b>(int)"  # needs CSV quoting
# (kind, start, end, stream, graph_id, name), times in us
RECORDS = [
    # step 1 [0, 1000): rope 0-100, A 150-400 and B 300-500 overlap (union
    # 150-500), HtoD 600-700, memset 900-1100 of which 900-1000 falls here.
    # busy 100 + 350 + 100 + 100 = 650
    ("kernel", 0, 100, 7, 0, ROPE),
    ("kernel", 150, 400, 7, 0, A),
    ("kernel", 300, 500, 13, 0, B),
    ("memcpy", 600, 700, 7, 0, "HtoD"),
    ("memset", 900, 1100, 7, 0, "memset"),
    # step 2 [1000, 2500): the memset's 1000-1100 covers rope 1000-1050 (100),
    # B 1200-1300 inside A 1200-1700 (500), C 2000-2200 (200); busy 800
    ("kernel", 1000, 1050, 7, 0, ROPE),
    ("kernel", 1200, 1700, 7, 0, A),
    ("kernel", 1200, 1300, 13, 0, B),
    ("kernel", 2000, 2200, 13, 0, C),
    # step 3 [2500, 3000), in graph 5: rope 2500-2550, A 2560-2990; busy 480
    ("kernel", 2500, 2550, 7, 5, ROPE),
    ("kernel", 2560, 2990, 7, 5, A),
    # step 4 [3000, 4000): rope 3000-3100, D 3500-3600; busy 200
    ("kernel", 3000, 3100, 7, 0, ROPE),
    ("kernel", 3500, 3600, 7, 0, D),
    # the last rope_table ends no step; what follows it is in no step
    ("kernel", 4000, 4050, 7, 0, ROPE),
    ("kernel", 4100, 4200, 7, 0, A),
]
PERIODS = [1.0, 1.5, 0.5, 1.0]  # ms
BUSY = [0.65, 0.8, 0.48, 0.2]  # ms
IDLE = [1 - b / p for b, p in zip(BUSY, PERIODS)]  # 0.35, 0.4667, 0.04, 0.8

from checklib import check, summary


def close(a, b):
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return abs(a - b) < 1e-9


def write_trace(path):
    rows = list(RECORDS)
    random.Random(1).shuffle(rows)
    with open(path, "w") as f:
        f.write("kind,start_ns,end_ns,stream,graph_id,name\n")
        for kind, a, b, stream, graph, name in rows:
            if "," in name:
                name = '"' + name.replace('"', '""') + '"'
            f.write(f"{kind},{a * U},{b * U},{stream},{graph},{name}\n")


def run(tmp, trace, *opts):
    out = os.path.join(tmp, "out.json")
    if os.path.exists(out):
        os.remove(out)
    p = subprocess.run([sys.executable, TOOL, trace, "--json", out, *opts], capture_output=True, text=True)
    if p.returncode != 0 or not os.path.exists(out):
        print(p.stdout + p.stderr)
        return None
    with open(out) as f:
        return json.load(f)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "t.csv")
        write_trace(trace)

        s = run(tmp, trace)
        check(s is not None, "cuda_idle.py runs and writes --json")
        if s is None:
            return summary()
        check(s["steps"] == 4, f"4 steps between 5 rope_table kernels (got {s['steps']})")
        check(close(s["periods_ms"], PERIODS), f"periods {s['periods_ms']} == {PERIODS}")
        check(close(s["busy_ms"], BUSY), f"busy {s['busy_ms']} == {BUSY} (overlaps once, boundary split)")
        check(close(s["idle_shares"], IDLE), f"idle shares {s['idle_shares']} == {IDLE}")
        check(close(s["median_period_ms"], 1.0), "median period 1.0 ms")
        check(close(s["median_busy_ms"], (0.48 + 0.65) / 2), "median busy 0.565 ms")
        check(close(s["median_idle_share"], (IDLE[0] + IDLE[1]) / 2), "median idle share")
        check(close(s["mean_idle_share"], sum(IDLE) / 4), "mean idle share")
        check(s["groups"].get("graph", {}).get("steps") == 1 and s["groups"].get("eager", {}).get("steps") == 3,
              "one graph step, three eager")
        top = {t["name"]: t for t in s["top"]}
        check(s["top"][0]["name"] == A and s["top"][0]["count"] == 3 and close(s["top"][0]["total_ms"], 1.18),
              "top kernel: A, 3 launches in steps, 1.18 ms (its launch after the last step not counted)")
        check(D in top and top[D]["count"] == 1, "a quoted name with a comma read whole")
        check("memcpy HtoD" in top and "memset" in top, "memcpy and memset listed by kind")
        check(close(top[ROPE]["total_ms"], 0.3) and close(top[ROPE]["share_of_busy"], 0.3 / sum(BUSY)),
              "rope_table total and share of busy")

        s = run(tmp, trace, "--skip", "1", "--last", "2")
        check(s is not None and close(s["idle_shares"], IDLE[2:]), "--skip 1 --last 2: steps 3 and 4")
        s = run(tmp, trace, "--min-period-ms", "0.9")
        check(s is not None and close(s["periods_ms"], [1.0, 1.5, 1.0]), "--min-period-ms 0.9 drops the 0.5 ms step")
        s = run(tmp, trace, "--skip", "1", "--min-period-ms", "0.9", "--last", "1")
        check(s is not None and close(s["periods_ms"], [1.0]) and close(s["idle_shares"], [IDLE[3]]),
              "--skip, then --min-period-ms, then --last")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
