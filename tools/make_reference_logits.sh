#!/usr/bin/env bash
# Produces tests/fixtures/smollm2-reference-logits.json: reference logits of
# the default model from llama.cpp, an implementation that is not ours; and
# tests/fixtures/arch/: tiny random-weight models of every architecture
# cascade runs (tools/make_arch_models.py) with llama.cpp's logits, greedy
# tokens and token ids of tricky strings for each (tiny-*-reference.json).
# WHAT=smollm2 or WHAT=arch makes only one of the two (default: both).
# WHAT=templates (also part of the default) renders the sdist's chat
# templates (models/templates/) with cascade and jinja2 and writes
# bench/results/chat-templates.json (tools/check_templates.py).
#
# How: pip downloads the source distribution of llama-cpp-python from PyPI
# (which vendors llama.cpp), cmake builds its llama library CPU-only, and
# tools/make_reference_logits.c (our small driver of llama.h) prints the
# top-20 logits at every position of a few prompts and the greedy 32-token
# continuation. Nothing of llama.cpp is committed; this takes ~15 minutes on
# 2 cores. Work directory: $REF_DIR (default /tmp/cascade-ref).
set -euo pipefail
cd "$(dirname "$0")/.."
REF_DIR=${REF_DIR:-/tmp/cascade-ref}
VER=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-tests/fixtures/smollm2-reference-logits.json}
mkdir -p "$REF_DIR"
if [ ! -d "$REF_DIR/llama_cpp_python-$VER" ]; then
  (cd "$REF_DIR" && pip download --no-binary :all: --no-deps "llama-cpp-python==$VER" &&
   tar xzf "llama_cpp_python-$VER.tar.gz")
fi
L="$REF_DIR/llama_cpp_python-$VER/vendor/llama.cpp"
check_templates() { make -s -j"$(nproc)" all && python3 tools/check_templates.py --templates "$L/models/templates"; }
if [ "${WHAT:-all}" = templates ]; then check_templates; exit; fi
if [ ! -f "$L/build/src/libllama.a" ]; then
  cmake -S "$L" -B "$L/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BLAS=OFF \
    -DGGML_OPENMP=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$L/build" -j"$(nproc)" --target llama
fi
g++ -O2 -x c tools/make_reference_logits.c -x none -DLCPP_VERSION="\"$VER\"" -I"$L/include" -I"$L/ggml/include" \
  -o "$REF_DIR/make_reference_logits" "$L/build/src/libllama.a" "$L/build/ggml/src/libggml.a" \
  "$L/build/ggml/src/libggml-cpu.a" "$L/build/ggml/src/libggml-base.a" -lpthread -lm -ldl 2>/dev/null ||
gcc -O2 -DLCPP_VERSION="\"$VER\"" -I"$L/include" -I"$L/ggml/include" -o "$REF_DIR/make_reference_logits" \
  tools/make_reference_logits.c "$L/build/src/libllama.a" "$L/build/ggml/src/libggml.a" \
  "$L/build/ggml/src/libggml-cpu.a" "$L/build/ggml/src/libggml-base.a" -lstdc++ -lpthread -lm -ldl
WHAT=${WHAT:-all}
if [ "$WHAT" = all ] || [ "$WHAT" = arch ]; then
  # The tiny models, then llama.cpp on each: f32 K/V and no flash attention (its
  # most exact path), the 10 largest logits per position, the manifest's prompts
  # and tricky strings.
  python3 tools/make_arch_models.py tests/fixtures/arch
  python3 - "$REF_DIR/make_reference_logits" <<'EOF'
import json, os, subprocess, sys
m = json.load(open("tests/fixtures/arch/manifest.json"))
env = dict(os.environ, REF_KV="f32", REF_FLASH="0", REF_TOPK="10")
for e in m["models"]:
    out = subprocess.run([sys.argv[1], e["file"], "2"] + e.get("prompts", m["prompts"]) + ["--tokenize"] + m["tricky"],
                         env=env, check=True, stdout=subprocess.PIPE).stdout
    json.loads(out)  # well-formed
    open(e["reference"], "wb").write(out)
    print("wrote", e["reference"])
EOF
fi
[ "$WHAT" = all ] && check_templates
[ "$WHAT" = all ] || [ "$WHAT" = smollm2 ] || exit 0
# The prompts: plain text, a ChatML conversation (special tokens parsed), and
# a longer passage (several pages of KV at page size 16).
"$REF_DIR/make_reference_logits" "$MODEL" 2 \
  "The capital of France is" \
  $'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n' \
  "In the beginning of the twentieth century, the small harbour town was known for its fishing fleet, its lighthouse and a bakery whose bread was carried by train to the capital every morning. When the railway closed," \
  > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "wrote $OUT"
