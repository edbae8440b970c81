#!/usr/bin/env bash
# Runs each test program given on the command line, echoes its output and
# adds up the "N passed, N failed" line each prints. A program that crashes or
# prints no summary counts as one failure. Exits non-zero on any failure.
set -u
# Tests measure nothing: let idle OpenMP threads sleep rather than spin, so a
# busy machine (another build, a parallel job) cannot stall every barrier.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
total_pass=0; total_fail=0
for t in "$@"; do
  name=$(basename "$t")
  out=$("$t" 2>&1); rc=$?
  printf '%s\n' "$out" | grep -E '^(FAIL|ok|skip)' | grep -v '^ok' | sed "s/^/[$name] /"
  line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n1)
  if [ -z "$line" ]; then
    printf '%s\n' "$out" | tail -n 20
    echo "[$name] crashed or printed no summary (exit $rc)"; total_fail=$((total_fail+1)); continue
  fi
  p=$(echo "$line" | awk '{print $1}'); f=$(echo "$line" | awk '{print $3}')
  total_pass=$((total_pass+p)); total_fail=$((total_fail+f))
  [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && { echo "[$name] exit $rc"; total_fail=$((total_fail+1)); }
  echo "[$name] $line"
done
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ]
