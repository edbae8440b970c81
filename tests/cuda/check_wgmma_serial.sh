#!/usr/bin/env bash
# check_wgmma_serial.sh LOG...: fails when ptxas reported that it serialized the wgmma
# of a kernel (its "Potential Performance Loss: wgmma ..." infos, C7510-C7520). Such a
# kernel still computes the right answer, so no test on the GPU would notice, only its speed
# (two experiments were once timed in that state: bench/HISTORY.md). The logs are nvcc's
# output, which the Makefile keeps next to each CUDA object ($(BUILD)/src/cuda/*.o.log).
# Prints "N passed, N failed" as the other tests do.
set -u
pass=0; fail=0
for log in "$@"; do
  if [ ! -f "$log" ]; then
    echo "FAIL $log: no nvcc log (an object built before the Makefile kept it: touch its .cu or make clean)"
    fail=$((fail + 1)); continue
  fi
  bad=$(grep -E "Potential Performance Loss: wgmma" "$log" || true)
  if [ -n "$bad" ]; then
    echo "FAIL $log: ptxas serialized wgmma in:"
    echo "$bad" | grep -o -E "function '[^']+'" | sort -u | sed 's/^/  /'
    fail=$((fail + 1))
  else
    echo "ok $log: no kernel has serialized wgmma"
    pass=$((pass + 1))
  fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
