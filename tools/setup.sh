#!/usr/bin/env bash
# Sets up a fresh Debian machine for cascade: the packages it builds against,
# the Python tools its tests and benchmarks use, HAProxy (deploy/: replicas
# behind it, and their test), the default model, and the build. Safe to run
# again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for p in build-essential pkg-config libpcre2-dev libxxhash-dev libjansson-dev libmicrohttpd-dev \
         python3 python3-pip curl clang haproxy; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Python packages for the tests' independent checks and the benchmark plots
py_need=()
python3 -c "import numpy" 2>/dev/null || py_need+=(numpy)
python3 -c "import matplotlib" 2>/dev/null || py_need+=(matplotlib)
python3 -c "import openai" 2>/dev/null || py_need+=(openai)  # check_server.py: the official client
python3 -c "import gguf" 2>/dev/null || py_need+=(gguf)      # tools/truncate_gguf.py and its check
python3 -c "import jinja2" 2>/dev/null || py_need+=(jinja2)  # tests/check_jinja.py: the reference for chat templates
if [ ${#py_need[@]} -gt 0 ]; then
  echo "setup: pip installing ${py_need[*]}"
  python3 -m pip install -q "${py_need[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${py_need[@]}"
fi

make model
make -j"$(nproc)"
# with the CUDA toolkit here, also the GPU build (build-cuda/: the same command,
# `--device auto` picks the GPU where there is one); tools/main_job.sh runs it
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc" ]; then
  echo "setup: $nvcc found: building build-cuda/ too (make CUDA=1)"
  PATH="$PATH:$(dirname "$nvcc")" make CUDA=1 BUILD=build-cuda -j"$(nproc)"
fi
