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
# llama.cpp comes from the source the reference fixtures use (the llama-cpp-python
# sdist; tools/make_reference_logits.sh fetches it), built here as its README
# says (cmake Release, native, its OpenMP threads) in a directory of its own.
# The files are the default model requantized by llama.cpp's llama-quantize
# (WHAT=quants-default of that script, run when they are missing).
#   usage: bash bench/vs_llamacpp.sh [THREADS]   (env: TYPES, ROUNDS, REF_DIR, RAW_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
ROUNDS=${ROUNDS:-3}
TYPES=${TYPES:-"Q4_K_M Q6_K Q8_0 Q4_1"}
REF_DIR=${REF_DIR:-/tmp/cascade-ref}
VER=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
L="$REF_DIR/llama_cpp_python-$VER/vendor/llama.cpp"
B="$L/build-bench"
file_of() {
  if [ "$1" = Q4_1 ]; then echo models/SmolLM2-135M-Instruct.Q4_1.gguf
  else echo "models/quants/SmolLM2-135M-Instruct.$1.gguf"; fi
}
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || make model
for t in $TYPES; do
  [ -f "$(file_of "$t")" ] || { WHAT=quants-default bash tools/make_reference_logits.sh > /dev/null; break; }
done
if [ ! -x "$B/bin/llama-bench" ] || [ ! -x "$B/bin/llama-batched-bench" ]; then
  [ -d "$L" ] || WHAT=templates bash tools/make_reference_logits.sh > /dev/null  # fetches the sdist
  cmake -S "$L" -B "$B" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF > /dev/null
  cmake --build "$B" -j"$(nproc)" --target llama-bench llama-batched-bench > /dev/null
fi
BUILD=${BUILD:-build}
make -s BUILD="$BUILD" -j"$(nproc)" "$BUILD/libcascade.a"
LIBS=$(pkg-config --libs libpcre2-8 libxxhash jansson libmicrohttpd 2>/dev/null || true)
cc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -o "$BUILD/model_bench" bench/model_bench.c "$BUILD/libcascade.a" \
  $LIBS -lm -lpthread
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
COMMIT=$(git -C "$L" rev-parse HEAD 2> /dev/null || echo "llama-cpp-python $VER")
mkdir -p bench/results
python3 bench/vs_llamacpp.py --dir "$W" --types "$TYPES" --rounds "$ROUNDS" --threads "$THREADS" \
  --llama-commit "$COMMIT" --sdist "llama-cpp-python $VER" --out bench/results/cpu-vs-llamacpp
