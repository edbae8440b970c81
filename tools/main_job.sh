#!/usr/bin/env bash
# The main job: set up a fresh machine (packages, the default model, the
# build; tools/setup.sh does only what is missing), then serve the default
# model through the OpenAI API with `cascade serve` on http://127.0.0.1:8000,
# on the GPU where the machine has one and the CUDA toolkit (`--device auto`)
# (a progress bar while the weights load on a terminal; Ctrl-C stops it).
# Requests from every client meet in one engine: continuous batching, prefix
# caching and cascade attention across clients.
#   usage: bash tools/main_job.sh [extra cascade serve options, e.g. --port 8080 --api-key KEY]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh >&2
# the CUDA build where setup made one and it runs here (it serves on the GPU
# when the machine has one, else on the CPU); otherwise the CPU build
bin=${BUILD:-build}/cascade
if [ -z "${BUILD:-}" ] && [ -x build-cuda/cascade ] && build-cuda/cascade --help >/dev/null 2>&1; then
  bin=build-cuda/cascade
fi
exec "$bin" serve "$@"
