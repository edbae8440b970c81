#!/usr/bin/env bash
# v17 probe calls on the H200 (bench/NOTES.md v17): bash bench/cuda/v17_calls.sh 1|2
# with the binaries in .devcarry (CARRY), built here from the commit this file came with.
case "${1:-1}" in
1)
O=${OUT:-/tmp/out}
for xv in 25 19 22 24; do
  echo "#### test XV=$xv"; CASCADE_CUDA_XV=$xv CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=1 TEST_TIMEOUT=90 OUT=$O/t$xv bash bench/cuda/run_h200.sh test 2>&1 | grep -E "test rc|passed|FAIL" | tail -4
done
echo "#### test XV=25, every tail on the many-rows list"; CASCADE_CUDA_TAIL_MIX_LEN=1000000000 CASCADE_CUDA_XV=25 CASCADE_TEST_KINDS=17 CASCADE_TEST_QUICK=1 TEST_TIMEOUT=90 OUT=$O/t25m bash bench/cuda/run_h200.sh test 2>&1 | grep -E "test rc|passed|FAIL" | tail -4
NCUDEC_VARIANTS="k17=CASCADE_CUDA_WIDE=17 diag=CASCADE_CUDA_WS_DIAG=1 qst=CASCADE_CUDA_XV=25 hint=CASCADE_CUDA_XV=17 tpf3=CASCADE_CUDA_XV=23 tpf6=CASCADE_CUDA_XV=24 o3=CASCADE_CUDA_TAIL_ORDER=3 pf4=CASCADE_CUDA_XV=22 last=CASCADE_CUDA_XV=20 o3hint=CASCADE_CUDA_TAIL_ORDER=3,CASCADE_CUDA_XV=17 pf2=CASCADE_CUDA_XV=21" \
 DEADLINE=280 OUT=$O/nc bash bench/cuda/run_h200.sh ncudec 2>&1 | grep -vE "^\s*$" | grep -v "^==" | tail -90
;;
2)
O=${OUT:-/tmp/out}
TL_RUNS="o1=32768,64,512 qst=32768,64,512,CASCADE_CUDA_XV=26 small=1024,128,128 smallq=1024,128,128,CASCADE_CUDA_XV=26 o3=32768,64,512,CASCADE_CUDA_TAIL_ORDER=3 hint=32768,64,512,CASCADE_CUDA_XV=19 b256=32768,256,512 u2048=16384,64,2048" \
 DEADLINE=150 OUT=$O/tl bash bench/cuda/run_h200.sh tl 2>&1 | grep -vE "^\s*$" | tail -50
DEC_CASES="32768,64,512;32768,256,512;16384,64,2048;16384,256,512;16384,64,128;1024,8,128;32768,8,2048;1024,128,128;4096,256,128;1024,64,512" \
 DEC_AB="17:CASCADE_CUDA_XV=25;17:CASCADE_CUDA_XV=17;17:CASCADE_CUDA_XV=20;17:CASCADE_CUDA_XV=21;17:CASCADE_CUDA_XV=22;17:CASCADE_CUDA_XV=23;17:CASCADE_CUDA_XV=24;17:CASCADE_CUDA_TAIL_ORDER=3;17:CASCADE_CUDA_XV=17,CASCADE_CUDA_TAIL_ORDER=3;17:CASCADE_CUDA_XV=18" DEC_ROUNDS=2 \
 DEADLINE=380 OUT=$O bash bench/cuda/run_h200.sh dec 2>&1 | grep -E "^r[12] P|device"
;;
esac
