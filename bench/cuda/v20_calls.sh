#!/usr/bin/env bash
# v20 calls on the GPU machine (bench/NOTES.md v20): bash bench/cuda/v20_calls.sh 1|2
# with the binaries of this commit in .devcarry (CARRY).
#   1: quick tests of XV 35 (the decode tails on the producer's spare warps) with every
#      tail on the many-rows list and with the default rule, the decode A/B against kind 17
#      (the tail warps' tile cost swept), then memcheck and racecheck of XV 35
#   2: the grid with the variant in GRID_ENV (ENV=VAL,...), timed against kind 17
#      as it was (GRID_AB), then the full tests of it
O=${OUT:-/tmp/out}
case "${1:-1}" in
1)
t0=$SECONDS
for mix in 1000000000 512; do
  echo "#### test XV=35, tails joining the many-rows list up to $mix keys"
  CASCADE_CUDA_TAIL_MIX_LEN=$mix CASCADE_CUDA_XV=35 CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=1 TEST_TIMEOUT=90 \
    OUT=$O/t$mix bash bench/cuda/run_h200.sh test 2>&1 | grep -E "test rc|passed|FAIL|device|H100|H200" | tail -6
done
echo "tests took $((SECONDS - t0)) s"
X=CASCADE_CUDA_XV=35
DEC_CASES="32768,64,512;32768,256,512;16384,64,2048;16384,256,512;16384,64,128;1024,128,128;4096,256,128;1024,64,512;32768,64,2048;16384,128,2048" \
 DEC_AB="17:$X;17:$X,CASCADE_CUDA_TW_COST=0.35;17:$X,CASCADE_CUDA_TW_COST=1.0;17:$X,CASCADE_CUDA_TW_COST=1.5" DEC_ROUNDS=2 \
 DEADLINE=$((420 - SECONDS)) OUT=$O bash bench/cuda/run_h200.sh dec 2>&1 | grep -E "^r[12] P|device|==" | tail -26
CASCADE_CUDA_XV=35 CASCADE_CUDA_TAIL_MIX_LEN=1000000000 SANITIZE_KINDS=17 DEADLINE=$((575 - SECONDS)) OUT=$O/san \
  bash bench/cuda/run_h200.sh sanitize 2>&1 | tail -8
;;
2)
env $(echo "${GRID_ENV:-CASCADE_CUDA_XV=35}" | tr , ' ') GRID_AB=${GRID_AB:-17:CASCADE_CUDA_XV=0} DEADLINE=420 OUT=$O bash bench/cuda/run_h200.sh grid 2>&1 | tail -75
env $(echo "${GRID_ENV:-CASCADE_CUDA_XV=35}" | tr , ' ') CASCADE_TEST_KINDS=17 TEST_TIMEOUT=$((580 - SECONDS)) OUT=$O/full bash bench/cuda/run_h200.sh test 2>&1 | grep -E "test rc|passed|FAIL" | tail -6
;;
esac
