#!/usr/bin/env bash
# v18 probe calls on the H200 (bench/NOTES.md v18): bash bench/cuda/v18_calls.sh 1|2
# with the binaries of this commit in .devcarry (CARRY).
#   1: the planners' host time (test_cuda_plan --time, if carried), quick tests of the probes (XV 31, 32, 34, 30, none) with every tail on the many-rows list, then the
#      decode A/B (two rounds) and timelines of order 4 (XV 18; XV 33: 31's mma.sync tails)
#   2: the grid with the variant in GRID_ENV (ENV=VAL,...), timed against kind 17
#      as it was (GRID_AB), then memcheck and racecheck of it
O=${OUT:-/tmp/out}
case "${1:-1}" in
1)
# one device call (600 s): the tests take at most 5 x 60 s (~20 s each so far), the decode A/B
# ends by 470 s, the timelines by 575 s (run_h200.sh's DEADLINE counts from
# its own start)
t0=$SECONDS
# the host side of a step on this machine's CPU (bench/NOTES.md v19; a few seconds)
[ -x .devcarry/test_cuda_plan ] && .devcarry/test_cuda_plan --time 400 $O/host-plan-gpuhost.json | tail -11
for v in "31:4" "32:1" "34:4" "30:4" "0:4"; do
  xv=${v%%:*}; ord=${v##*:}
  echo "#### test XV=$xv ORDER=$ord, every tail on the many-rows list"
  CASCADE_CUDA_TAIL_MIX_LEN=1000000000 CASCADE_CUDA_TAIL_ORDER=$ord CASCADE_CUDA_XV=$xv CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=1 TEST_TIMEOUT=60 OUT=$O/t$xv$ord bash bench/cuda/run_h200.sh test 2>&1 | grep -E "test rc|passed|FAIL" | tail -4
done
echo "tests took $((SECONDS - t0)) s"
O4=CASCADE_CUDA_TAIL_ORDER=4
DEC_CASES="32768,64,512;32768,256,512;16384,64,2048;16384,256,512;16384,64,128;1024,128,128;4096,256,128;1024,64,512;32768,64,2048;16384,128,2048" \
 DEC_AB="17:CASCADE_CUDA_XV=32;17:$O4,CASCADE_CUDA_TAIL_COST=0.9;17:$O4,CASCADE_CUDA_XV=30;17:$O4,CASCADE_CUDA_XV=31,CASCADE_CUDA_TAIL_COST=0.2;17:$O4,CASCADE_CUDA_XV=31,CASCADE_CUDA_TAIL_COST=0.3;17:$O4,CASCADE_CUDA_XV=31,CASCADE_CUDA_TAIL_COST=0.45;17:$O4,CASCADE_CUDA_XV=31,CASCADE_CUDA_TAIL_COST=0.7;17:$O4,CASCADE_CUDA_XV=34,CASCADE_CUDA_TAIL_COST=0.4" DEC_ROUNDS=2 \
 DEADLINE=$((470 - SECONDS)) OUT=$O bash bench/cuda/run_h200.sh dec 2>&1 | grep -E "^r[12] P|device"
TL_RUNS="o4=32768,64,512,$O4,CASCADE_CUDA_TAIL_COST=0.9 o4m=32768,64,512,$O4,CASCADE_CUDA_XV=33,CASCADE_CUDA_TAIL_COST=0.3 o4mu=16384,64,2048,$O4,CASCADE_CUDA_XV=33,CASCADE_CUDA_TAIL_COST=0.3" \
 DEADLINE=$((575 - SECONDS)) OUT=$O/tl bash bench/cuda/run_h200.sh tl 2>&1 | grep -vE "^\s*$" | tail -24
;;
2)
# e.g. GRID_ENV=CASCADE_CUDA_TAIL_ORDER=4,CASCADE_CUDA_XV=31,CASCADE_CUDA_TAIL_COST=0.3
env $(echo "${GRID_ENV:-}" | tr , ' ') GRID_AB=${GRID_AB:-17:CASCADE_CUDA_TAIL_ORDER=1,CASCADE_CUDA_XV=0} DEADLINE=400 OUT=$O bash bench/cuda/run_h200.sh grid 2>&1 | tail -75
env $(echo "${GRID_ENV:-}" | tr , ' ') CASCADE_CUDA_TAIL_MIX_LEN=1000000000 SANITIZE_KINDS=17 DEADLINE=160 OUT=$O/san bash bench/cuda/run_h200.sh sanitize 2>&1 | tail -8
;;
esac
