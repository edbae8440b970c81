#!/usr/bin/env bash
# The engine's tests (tests/test_engine.c) on the GPU: cascade on and off,
# prefix cache on and off, preemption, chunked prefill, batched against alone,
# bad requests and aborts, the same assertions as on the CPU.
#   tests/cuda/engine_on_gpu.sh [MODEL.gguf]   (BUILD: the build folder, default build-cuda)
exec "${BUILD:-build-cuda}/tests/test_engine" --device cuda "$@"
