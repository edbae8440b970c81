#!/usr/bin/env bash
# One device call on the H200: build the CUDA backend, run its tests against
# the float64 reference, compute-sanitizer (memcheck, racecheck) on small
# cases, the benchmarks (JSON under $OUT), and the CPU test suite once.
# Usage: bash bench/cuda/run_h200.sh [steps...]  (default: all)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=build-h200
steps=${*:-"build test bench sanitize cputest grid"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
nproc
has() { [[ " $steps " == *" $1 "* ]]; }
if has build; then
  ( time make -j16 CUDA=1 BUILD=$B cuda-build-check ) > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  grep -i "warning" "$OUT/build.log" | head
fi
if has test; then
  echo "== test-cuda"; timeout 150 $B/tests/cuda/test_cuda_attn 2>&1 | tee "$OUT/test_cuda.log" | grep -v "^  " | tail -25
  grep "^  " "$OUT/test_cuda.log" | head -30
fi
if has bench; then
  echo "== bench"
  timeout 100 $B/bench/cuda/attn_bench_cuda --batch 64 --prefix 32768 --suffix 512 --json "$OUT/one.json" 2>&1 | tail -4
  timeout 60 $B/bench/cuda/attn_bench_cuda --unshared --prefill 16384 --json "$OUT/unshared_prefill.json" 2>&1 | grep -v "^ *P " | tail -4
fi
if has bench2; then
  echo "== bench, wide2 kernel (2 m-tiles per warp)"
  CASCADE_CUDA_WIDE=2 timeout 100 $B/bench/cuda/attn_bench_cuda --batch 64 --prefix 32768 --suffix 512 --json "$OUT/one_wide2.json" 2>&1 | tail -1
  CASCADE_CUDA_WIDE=2 timeout 60 $B/bench/cuda/attn_bench_cuda --prefill 16384 --json "$OUT/prefill_wide2.json" 2>&1 | grep prefill
fi
if has sanitize; then
  echo "== memcheck"
  CASCADE_TEST_QUICK=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tests/cuda/test_cuda_attn > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|Invalid" "$OUT/memcheck.log" | head -5
  echo "== racecheck"
  CASCADE_TEST_QUICK=2 timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $B/tests/cuda/test_cuda_attn > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|hazard" "$OUT/racecheck.log" | head -5
fi
if has cputest; then
  echo "== CPU make test"
  grep -o -m1 'avx512[a-z]*' /proc/cpuinfo | sort -u | head -3
  ( timeout 200 make -j16 -k BUILD=build-cpu test ) > "$OUT/cpu_test.log" 2>&1; echo "make test rc=$?"; grep -E "FAIL|passed, |crashed|error" "$OUT/cpu_test.log" | tail -8
  # the attention tests alone, linked without the model layer (no pcre2 there)
  for t in tests/test_attn*.c tests/test_core*.c; do [ -f "$t" ] || continue
    n=build-cpu/tests/$(basename "$t" .c); mkdir -p build-cpu/tests
    make -s BUILD=build-cpu build-cpu/libcascade_attn.a >/dev/null 2>&1
    gcc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -Itests -o "$n" "$t" build-cpu/libcascade_attn.a -fopenmp -lm -lpthread 2>&1 | tail -3
    echo "-- $t"; timeout 200 "$n" 2>&1 | grep -E "FAIL|passed, |simd|avx" | tail -8
  done
fi
if has grid; then
  echo "== grid"
  timeout 300 $B/bench/cuda/attn_bench_cuda --grid --json "$OUT/h200-attention.json" > "$OUT/grid.txt" 2> "$OUT/grid.err"; echo "grid rc=$?"; tail -3 "$OUT/grid.err"; cat "$OUT/grid.txt"
fi
if has grid && [ -f "$OUT/h200-attention.json" ]; then
  python3 bench/cuda/plot_h200.py "$OUT/h200-attention.json" bench/cuda/anchor-flashinfer-grid.json "$OUT/h200-attention.png" "$OUT/table.md" 2>&1 | tail -2
fi
