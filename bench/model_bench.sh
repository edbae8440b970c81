#!/usr/bin/env bash
# CPU model benchmark: prefill and decode tokens/s of the default model at
# 2 threads (single sequence and 32 sequences) against the single-sequence
# decode roofline (weight bytes per token over the read bandwidth measured in
# the same run). Builds the library, compiles bench/model_bench.c against it,
# and writes bench/results/cpu-model.json.
#   usage: bash bench/model_bench.sh [THREADS] [SEQS]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
SEQS=${2:-32}
BUILD=${BUILD:-build}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$MODEL" ] || make model
make -s BUILD="$BUILD" -j"$(nproc)" "$BUILD/libcascade.a"
LIBS=$(pkg-config --libs libpcre2-8 libxxhash jansson libmicrohttpd 2>/dev/null || true)
cc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -o "$BUILD/model_bench" bench/model_bench.c "$BUILD/libcascade.a" \
  $LIBS -lm -lpthread
mkdir -p bench/results
OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=active "$BUILD/model_bench" "$MODEL" "$THREADS" "$SEQS" \
  > bench/results/cpu-model.json.tmp
mv bench/results/cpu-model.json.tmp bench/results/cpu-model.json
cat bench/results/cpu-model.json
