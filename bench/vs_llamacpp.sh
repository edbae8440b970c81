#!/usr/bin/env bash
# cascade beside llama.cpp on the same GGUF files, the same threads and the
# same machine: prompt processing, single-stream decode and 32 sequences'
# decode throughput. llama.cpp runs its own tools: llama-bench (pp256 from an
# empty context, tg64 at a depth of 256: the shape bench/model_bench.c runs)
# and llama-batched-bench (32 sequences of 64 prompt tokens, 64 decode steps),
# each with flash attention off and on, its better of the two kept. cascade
# runs bench/model_bench.c on the same file. The two alternate, ROUNDS times,
# and each number is the best of its rounds (a neighbour on a shared machine
# only ever slows a run down). Writes bench/results/cpu-vs-llamacpp.json and
# .png (bench/vs_llamacpp.py).
#
# The files and the llama.cpp build: bench/llamacpp_env.sh.
#   usage: bash bench/vs_llamacpp.sh [THREADS]   (env: TYPES, ROUNDS, REF_DIR, RAW_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
ROUNDS=${ROUNDS:-3}
TYPES=${TYPES:-"Q4_K_M Q6_K Q8_0 Q4_1"}
. bench/llamacpp_env.sh
# the raw outputs of every run (kept where RAW_DIR names a directory)
if [ -n "${RAW_DIR:-}" ]; then W=$RAW_DIR; mkdir -p "$W"; else W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; fi
for r in $(seq "$ROUNDS"); do
  for t in $TYPES; do
    f=$(file_of "$t")
    echo "round $r: $t" >&2
    OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=active "$BUILD/model_bench" "$f" "$THREADS" 32 > "$W/cascade-$t-$r.json"
    "$B/bin/llama-bench" -m "$f" -t "$THREADS" -p 256 -n 0 -fa 0,1 -r 3 -o json 2> /dev/null > "$W/lb-pp-$t-$r.json"
    "$B/bin/llama-bench" -m "$f" -t "$THREADS" -p 0 -n 64 -d 256 -fa 0,1 -r 3 -o json 2> /dev/null > "$W/lb-tg-$t-$r.json"
    for fa in off on; do
      "$B/bin/llama-batched-bench" -m "$f" -t "$THREADS" -tb "$THREADS" -c 4096 -b 2048 -ub 512 -npp 64 -ntg 64 \
        -npl 32 -fa "$fa" --output-format jsonl 2> /dev/null | grep '^{' > "$W/bb-$fa-$t-$r.jsonl"
    done
  done
done
mkdir -p bench/results
python3 bench/vs_llamacpp.py --dir "$W" --types "$TYPES" --rounds "$ROUNDS" --threads "$THREADS" \
  --llama-commit "$COMMIT" --sdist "llama-cpp-python $VER" --out bench/results/cpu-vs-llamacpp
