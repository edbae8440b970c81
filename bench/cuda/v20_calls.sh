#!/usr/bin/env bash
# v20 calls on the GPU machine (bench/NOTES.md v20): bash bench/cuda/v20_calls.sh 1|2
# with the binaries of this commit in .devcarry (CARRY). Every step's output goes to
# files under $OUT (log.txt: the summaries), so that a step stopped by its timeout
# loses only itself.
#   1: quick tests of XV 35 (the decode tails on the producer's spare warps) with every
#      tail on the many-rows list, the headline alone (a hang shows here in 40 s), the
#      16k prefill with kinds 17 and 10, the
#      decode A/B against kind 17 (the tail warps' tile cost swept; and kind 10, cluster
#      multicast, with its wgmma no longer serialized: NOTES v21), then memcheck and
#      racecheck of XV 35
#   2: the grid with the variant in GRID_ENV (ENV=VAL,...), timed against kind 17
#      as it was (GRID_AB), then the full tests of it
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=$O/log.txt
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BB=.devcarry/attn_bench_cuda
case "${1:-1}" in
1)
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader >> "$L"
CASCADE_CUDA_TAIL_MIX_LEN=1000000000 CASCADE_CUDA_XV=35 CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=1 TEST_TIMEOUT=90 \
  OUT=$O/t bash bench/cuda/run_h200.sh test > "$O/test.txt" 2>&1
grep -E "test rc|passed|FAIL" "$O/test.txt" | sed 's/^/test XV35: /' >> "$L"
for v in 0 35 35d; do
  # 35d: the tail warps compute nothing (CASCADE_CUDA_WS_DIAG=4, timing only)
  CASCADE_CUDA_WS_DIAG=$([ $v = 35d ] && echo 4 || echo 0) CASCADE_CUDA_XV=${v%d} CASCADE_CUDA_WIDE=17 \
    timeout 40 $BB --batch 64 --prefix 32768 --suffix 512 > "$O/head$v.txt" 2>&1
  echo "headline XV $v rc=$? $(tail -1 "$O/head$v.txt")" >> "$L"
done
# the 16k causal prefill, kind 17 and kind 10 (multicast, no longer serialized) alternating
for r in 1 2; do for k in 17 10; do
  CASCADE_CUDA_WIDE=$k timeout 40 $BB --prefill 16384 --iters 20 > "$O/pf${k}_$r.txt" 2>&1
  echo "prefill kind $k round $r rc=$? $(grep -E 'prefill L' "$O/pf${k}_$r.txt" | tail -1)" >> "$L"
done; done
X=CASCADE_CUDA_XV=35
for r in 1 2; do
CASCADE_BENCH_AB="17:$X,CASCADE_CUDA_TW_COST=1000;17:$X,CASCADE_CUDA_TW_COST=0.35;17:$X;17:$X,CASCADE_CUDA_TW_COST=1.0;10" CASCADE_CUDA_WIDE=17 \
  timeout 200 $BB --cases "32768,64,512;32768,256,512;16384,64,2048;16384,256,512;16384,64,128;1024,128,128;4096,256,128;1024,64,512;32768,64,2048;16384,128,2048" \
  --json "$O/dec$r.json" > "$O/dec$r.txt" 2>&1
echo "dec round $r rc=$?" >> "$L"; grep -E '^P |device' "$O/dec$r.txt" >> "$L"
done
CASCADE_CUDA_XV=35 CASCADE_CUDA_TAIL_MIX_LEN=1000000000 CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=1 \
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 .devcarry/test_cuda_attn > "$O/memcheck.txt" 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$O/memcheck.txt" | head -1)" >> "$L"
CASCADE_CUDA_XV=35 CASCADE_CUDA_TAIL_MIX_LEN=1000000000 CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=2 \
  timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 .devcarry/test_cuda_attn > "$O/racecheck.txt" 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$O/racecheck.txt" | head -2 | tr '\n' ' ')" >> "$L"
( cd "$O" && tar czf rest.tgz head0.txt head35.txt head35d.txt pf*_?.txt test.txt memcheck.txt dec1.txt dec2.txt t 2>/dev/null &&
  rm -rf head0.txt head35.txt head35d.txt pf*_?.txt test.txt memcheck.txt dec1.txt dec2.txt t )
cat "$L"
;;
2)
env $(echo "${GRID_ENV:-CASCADE_CUDA_XV=35}" | tr , ' ') GRID_AB=${GRID_AB:-17:CASCADE_CUDA_XV=0} DEADLINE=420 OUT=$O bash bench/cuda/run_h200.sh grid > "$O/grid.txt" 2>&1
tail -75 "$O/grid.txt"
env $(echo "${GRID_ENV:-CASCADE_CUDA_XV=35}" | tr , ' ') CASCADE_TEST_KINDS=17 TEST_TIMEOUT=$((580 - SECONDS)) OUT=$O/full bash bench/cuda/run_h200.sh test > "$O/full.txt" 2>&1
grep -E "test rc|passed|FAIL" "$O/full.txt" | tail -6
;;
esac
