#!/usr/bin/env bash
# Decode throughput against the number of sequences decoded together, cascade
# beside llama.cpp on the same GGUF files, threads and machine: for each count
# in NPL, that many sequences of 64 prompt tokens then 64 decode steps
# (bench/model_bench.c --sweep; llama-batched-bench -npp 64 -ntg 64 -npl
# COUNTS, flash attention off and on, its better kept per count). With BASE (a
# git revision) the same sweep also runs on that revision's library, built in
# a worktree of its own, so that a change is measured beside what it changed
# in the same run. Rounds alternate and each number is the best of its rounds.
# Writes bench/results/cpu-seqs-sweep.json and .png (bench/seqs_sweep.py).
#   usage: bash bench/seqs_sweep.sh [THREADS]   (env: TYPES, NPL, ROUNDS, BASE, REF_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
ROUNDS=${ROUNDS:-2}
TYPES=${TYPES:-"Q4_K_M Q8_0 Q4_1"}
NPL=${NPL:-"1 2 3 4 6 8 12 16 32"}
CASCADE_COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo "+changes")
. bench/llamacpp_env.sh
W=$(mktemp -d)
trap 'rm -rf "$W"; [ -z "${BASE:-}" ] || git worktree remove --force "$W/base" 2> /dev/null || true' EXIT
if [ -n "${BASE:-}" ]; then
  git worktree add -q --detach "$W/base" "$BASE"
  make -s -C "$W/base" -j"$(nproc)" build/libcascade.a
  cc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -o "$W/model_bench_base" bench/model_bench.c "$W/base/build/libcascade.a" \
    $LIBS -lm -lpthread
fi
list=$(echo $NPL | tr ' ' ',')
for r in $(seq "$ROUNDS"); do
  for t in $TYPES; do
    f=$(file_of "$t")
    echo "round $r: $t" >&2
    OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=active "$BUILD/model_bench" "$f" "$THREADS" --sweep "$list" \
      > "$W/cascade-$t-$r.json" 2> /dev/null
    if [ -n "${BASE:-}" ]; then
      OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=active "$W/model_bench_base" "$f" "$THREADS" --sweep "$list" \
        > "$W/base-$t-$r.json" 2> /dev/null
    fi
    for fa in off on; do
      "$B/bin/llama-batched-bench" -m "$f" -t "$THREADS" -tb "$THREADS" -c 4096 -b 2048 -ub 512 -npp 64 -ntg 64 \
        -npl "$list" -fa "$fa" --output-format jsonl 2> /dev/null | grep '^{' > "$W/bb-$fa-$t-$r.jsonl"
    done
  done
done
mkdir -p bench/results
python3 bench/seqs_sweep.py --dir "$W" --types "$TYPES" --rounds "$ROUNDS" --threads "$THREADS" \
  --llama-commit "$COMMIT" --sdist "llama-cpp-python $VER" --base "${BASE:-}" \
  --cascade-commit "$CASCADE_COMMIT" --out bench/results/cpu-seqs-sweep
