#!/usr/bin/env bash
# The GPU forward's and the engine's CUDA path on the CPU, against the
# stand-ins of tests/cuda/gpu_stub.c (Makefile: STUB_TESTS): test_gpu_model
# (against the CPU forward, cascade against flat, chunked and mixed batches,
# bad batches) and test_engine --device cuda (cascade, prefix cache,
# preemption, chunked prefill, alone against batched, aborts), the latter
# again split over 3 stand-in GPUs (tensor parallelism through the NCCL
# stand-in of tests/cuda/nccl_stub.c), on the default model cut to 4 layers.
# Prints one "N passed, N failed" line for run_all.sh.
B=${BUILD:-build-cuda}; M=${STUB_MODEL:-$B/stub-model.gguf}
p=0; f=0
for t in "$B/tests/cuda/stub_test_gpu_model $M" "$B/tests/cuda/stub_test_engine --device cuda $M" \
         "$B/tests/cuda/stub_test_engine --device cuda --tensor-parallel 3 $M"; do
  out=$($t 2>&1); rc=$?
  printf '%s\n' "$out" | grep -vE '^ok '
  line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n1)
  if [ -z "$line" ]; then f=$((f + 1)); continue; fi
  p=$((p + $(echo "$line" | awk '{print $1}'))); f=$((f + $(echo "$line" | awk '{print $3}')))
  [ "$rc" -ne 0 ] && [ "$(echo "$line" | awk '{print $3}')" -eq 0 ] && f=$((f + 1))
done
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
