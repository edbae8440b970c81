#!/usr/bin/env bash
# One device call on an H100 or H200: the CUDA backend's tests (every row of
# every output against the float64 reference), the gates' proof (faults that
# must fail them), an A/B of this build against an older attn_bench_cuda in
# the same process order, the benchmark grid, `cascade attn-bench --backend
# cuda`, and compute-sanitizer on small cases; logs and JSON under $OUT, a
# short summary last.
#
# Binaries are built on the development machine (make CUDA=1) and carried in
# .devcarry (the device machine lacks PCRE2, jansson, libmicrohttpd and
# xxHash; ../shared/tools/carry-libs copies them to .devcarry/lib):
#   .devcarry/{test_cuda_attn, test_cuda_plan, attn_bench_cuda, cascade,
#   old_attn_bench_cuda (optional: the A/B), lib/}
# Usage: bash bench/cuda/run_device.sh [steps...]
#   steps: test faults ab grid cli sanitize (default: all of them, in that order),
#   and prefill (our 16k causal prefill and PyTorch's, bench/cuda/torch_prefill.py,
#   alternating PF_ROUNDS times)
#   env: AB_CASES (P,B,U ...), AB_ROUNDS, AB_ORDER (default "new old": which
#   build runs first in each round), GRID_RESERVE (seconds the grid leaves
#   for the steps after it), DEADLINE (seconds for the whole script, default 560)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/cascade-dev; rm -rf "$W"; mkdir -p "$W"
steps=${*:-"test faults ab grid cli sanitize"}
has() { [[ " $steps " == *" $1 "* ]]; }
DEADLINE=${DEADLINE:-560}
left() { echo $((DEADLINE - SECONDS)); }
C=${CARRY:-.devcarry}
export LD_LIBRARY_PATH=$PWD/$C/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
T=$C/test_cuda_attn; BB=$C/attn_bench_cuda; OB=$C/old_attn_bench_cuda; CAS=$C/cascade
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$W/gpu.txt"
for b in "$T" "$BB" "$CAS"; do ldd "$b" | grep "not found" && echo "missing libraries for $b"; done

if has test; then
  echo "== tests, $(left) s left"
  timeout 240 "$T" > "$W/test_cuda.log" 2>&1; echo "test_cuda_attn rc=$?"
  grep -E "^(FAIL|==)|passed" "$W/test_cuda.log" | tail -8
  grep -E "gate .* (as planned|skipped|id off)" "$W/test_cuda.log" | head -16
  "$C/test_cuda_plan" > "$W/test_cuda_plan.log" 2>&1; echo "test_cuda_plan rc=$? $(tail -2 "$W/test_cuda_plan.log" | tr '\n' ' ')"
fi
if has faults; then
  echo "== faults: every run with a fault must fail its gate (rc 0: all caught), $(left) s left"
  for f in skip-tile page-off; do
    timeout 60 "$BB" --fault $f --cases "1024,8,128;32768,8,128" --json "$W/fault_$f.json" > "$W/fault_$f.txt" 2> "$W/fault_$f.err"
    echo "fault $f rc=$? ($(grep -c 'NOT caught' "$W/fault_$f.err") runs not caught)"
  done
fi
if has ab && [ -x "$OB" ]; then
  R=${AB_ROUNDS:-3}
  echo "== A/B: new against old attn_bench_cuda, alternating (${AB_ORDER:-new old}), $R rounds, $(left) s left"
  for r in $(seq 1 "$R"); do
    for v in ${AB_ORDER:-new old}; do
      b=$BB; [ $v = old ] && b=$OB
      timeout 60 "$b" --cases "${AB_CASES:-32768,64,512;1024,8,128}" --json "$W/ab_${v}_$r.json" > /dev/null 2> "$W/ab_${v}_$r.err"
      timeout 60 "$b" --unshared --json "$W/ab_${v}_unshared_$r.json" > /dev/null 2>> "$W/ab_${v}_$r.err"
    done
  done
  python3 - "$W" "$R" <<'PY' | tee "$OUT/ab.txt"
import json, sys, statistics as st
w, R = sys.argv[1], int(sys.argv[2])
out = {}
for v in ("new", "old"):
    for r in range(1, R + 1):
        try:
            d = json.load(open(f"{w}/ab_{v}_{r}.json"))
            for c in d["cases"]:
                for k in ("flat_ms", "cascade_ms", "planned_ms"):
                    if c.get(k) is not None:
                        out.setdefault((c["P"], c["B"], c["U"], k), {}).setdefault(v, []).append(c[k])
            u = json.load(open(f"{w}/ab_{v}_unshared_{r}.json"))["flat_unshared"]
            out.setdefault((0, 64, 4096, "flat_ms"), {}).setdefault(v, []).append(u["ms"])
        except Exception as e:
            print("missing", v, r, e)
res = []
for key, d in sorted(out.items()):
    if "new" in d and "old" in d:
        n, o = st.median(d["new"]), st.median(d["old"])
        print(f"P {key[0]:5d} B {key[1]:3d} U {key[2]:4d} {key[3]:11s} new {n:.4f} old {o:.4f} ms  new/old {n/o:.3f}  "
              f"(new {min(d['new']):.4f}-{max(d['new']):.4f}, old {min(d['old']):.4f}-{max(d['old']):.4f})")
        res.append({"P": key[0], "B": key[1], "U": key[2], "what": key[3], "new_ms": d["new"], "old_ms": d["old"]})
json.dump({"what": "attn_bench_cuda of this tree (new) against the one before the clean-up (old), run alternately "
           "in one device call, graph replay medians per run", "runs": res}, open(f"{w}/ab.json", "w"), indent=1)
PY
  cp "$W/ab.json" "$OUT/" 2>/dev/null
fi
if has grid; then
  echo "== grid, $(left) s left"
  timeout $(( $(left) - ${GRID_RESERVE:-120} )) "$BB" --grid --unshared --prefill 16384 --json "$OUT/attention-grid.json" > "$OUT/grid.txt" 2> "$W/grid.err"
  echo "grid rc=$?"; grep -E "^device|unshared|prefill|runs" "$W/grid.err"
  tail -62 "$OUT/grid.txt" | awk 'NR==1 || NR%6==2'
fi
if has prefill; then
  echo "== prefill 16k causal, ours and PyTorch's alternating, $(left) s left"
  for r in $(seq 1 "${PF_ROUNDS:-3}"); do
    timeout 60 "$BB" --prefill 16384 --json "$W/pf_$r.json" 2>&1 | grep -E "prefill" | sed "s/^/ours r$r /"
    timeout 120 python3 bench/cuda/torch_prefill.py 16384 2>&1 | tee -a "$W/torch_prefill.jsonl" | sed "s/^/torch r$r /"
  done
fi
if has cli && [ $(left) -gt 60 ]; then
  echo "== cascade attn-bench --backend cuda, $(left) s left"
  timeout 90 "$CAS" attn-bench --backend cuda --batch 64 --prefix 32768 --suffix 512 --repeats 30 --warmup 5 --json > "$W/cli_headline.json" 2> "$W/cli.err"; echo "cli rc=$?"
  timeout 90 "$CAS" attn-bench --backend cuda --tree '32*8192(16*2048)+32*4096' --suffix 256 --repeats 30 --warmup 5 2>&1 | tee "$W/cli_tree.txt" | tail -5
  python3 -c "import json;d=json.load(open('$W/cli_headline.json'));print({k:d[k] for k in ['device','kernel','flat_ms','cascade_ms','max_rel_err_cascade','bad_rows','flat_GBps','peak_GBps']})" 2>&1 | tail -1
fi
if has sanitize && [ $(left) -gt 60 ]; then
  echo "== memcheck / racecheck (quick), $(left) s left"
  timeout $(( $(left) / 2 )) compute-sanitizer --tool memcheck --error-exitcode 9 "$T" --quick 1 > "$W/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed" "$W/memcheck.log" | head -3
  timeout $(( $(left) - 5 )) compute-sanitizer --tool racecheck --error-exitcode 9 "$T" --quick 2 > "$W/racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed" "$W/racecheck.log" | head -3
fi
tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null
cp "$W/test_cuda.log" "$OUT/" 2>/dev/null
true
