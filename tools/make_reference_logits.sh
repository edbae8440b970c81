#!/usr/bin/env bash
# Produces tests/fixtures/smollm2-reference-logits.json: reference logits of
# the default model from llama.cpp, an implementation that is not ours; and
# tests/fixtures/arch/: tiny random-weight models of every architecture
# cascade runs (tools/make_arch_models.py) with llama.cpp's logits, greedy
# tokens and token ids of tricky strings for each (tiny-*-reference.json);
# tests/fixtures/quants/: a tiny random-weight Llama model
# (tools/make_quant_models.py) quantized by llama.cpp's llama-quantize to
# each type, with llama.cpp's references (WHAT=quants); and the default model
# requantized by it to the same types in models/quants/ (git-ignored, 88-145
# MB each) with its references there (WHAT=quants-default; tests/test_quants
# reads them where present). WHAT=templates (also part of the default)
# renders the sdist's chat templates (models/templates/) with cascade and
# jinja2 and writes bench/results/chat-templates.json
# (tools/check_templates.py). WHAT=smollm2, arch, quants, quants-default or
# templates makes only that part (default: all five).
#
# How: pip downloads the source distribution of llama-cpp-python from PyPI
# (which vendors llama.cpp), cmake builds its llama library CPU-only (and
# llama-quantize for the quants part), and
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
WHAT=${WHAT:-all}
# The tools are configured (only the targets named are built): llama-quantize for the quants part.
if [ ! -f "$L/build/src/libllama.a" ] || ! grep -q "LLAMA_BUILD_TOOLS:BOOL=ON" "$L/build/CMakeCache.txt"; then
  cmake -S "$L" -B "$L/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BLAS=OFF \
    -DGGML_OPENMP=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
fi
[ -f "$L/build/src/libllama.a" ] || cmake --build "$L/build" -j"$(nproc)" --target llama
if [ "${WHAT#quants}" != "$WHAT" ] || [ "$WHAT" = all ]; then
  [ -x "$L/build/bin/llama-quantize" ] ||
    cmake --build "$L/build" -j"$(nproc)" --target llama-quantize
fi
g++ -O2 -x c tools/make_reference_logits.c -x none -DLCPP_VERSION="\"$VER\"" -I"$L/include" -I"$L/ggml/include" \
  -o "$REF_DIR/make_reference_logits" "$L/build/src/libllama.a" "$L/build/ggml/src/libggml.a" \
  "$L/build/ggml/src/libggml-cpu.a" "$L/build/ggml/src/libggml-base.a" -lpthread -lm -ldl 2>/dev/null ||
gcc -O2 -DLCPP_VERSION="\"$VER\"" -I"$L/include" -I"$L/ggml/include" -o "$REF_DIR/make_reference_logits" \
  tools/make_reference_logits.c "$L/build/src/libllama.a" "$L/build/ggml/src/libggml.a" \
  "$L/build/ggml/src/libggml-cpu.a" "$L/build/ggml/src/libggml-base.a" -lstdc++ -lpthread -lm -ldl
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
# The default model's prompts: plain text, a ChatML conversation (special
# tokens parsed), and a longer passage (several pages of KV at page size 16).
SMOLLM2_PROMPTS=(
  "The capital of France is"
  $'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n'
  "In the beginning of the twentieth century, the small harbour town was known for its fishing fleet, its lighthouse and a bakery whose bread was carried by train to the capital every morning. When the railway closed,"
)
Q="$L/build/bin/llama-quantize"
if [ "$WHAT" = all ] || [ "$WHAT" = quants ]; then
  QDIR=tests/fixtures/quants
  # the tiny model, quantized by llama.cpp to each type of the manifest, and
  # llama.cpp's references on each (f32 K/V, no flash attention, top 10)
  python3 tools/make_quant_models.py "$QDIR" "$REF_DIR/tiny-quant-f32.gguf"
  python3 - "$Q" "$REF_DIR/make_reference_logits" "$REF_DIR/tiny-quant-f32.gguf" "$QDIR/manifest.json" <<'EOF'
import collections, json, os, subprocess, sys
import gguf
quantize, ref, src, mpath = sys.argv[1:]
m = json.load(open(mpath))
env = dict(os.environ, REF_KV="f32", REF_FLASH="0", REF_TOPK="10")
for e in m["models"]:
    subprocess.run([quantize, src, e["file"], e["ftype"], "2"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r = gguf.GGUFReader(e["file"])
    e["tensor_types"] = dict(sorted(collections.Counter(t.tensor_type.name.lower() for t in r.tensors).items()))
    out = subprocess.run([ref, e["file"], "2"] + m["prompts"] + ["--tokenize"] + m["tricky"],
                         env=env, check=True, stdout=subprocess.PIPE).stdout
    json.loads(out)  # well-formed
    open(e["reference"], "wb").write(out)
    print("wrote", e["file"], os.path.getsize(e["file"]), "bytes,", e["tensor_types"])
with open(mpath, "w") as f:
    json.dump(m, f, indent=1, ensure_ascii=False)
    f.write("\n")
EOF
fi
if [ "$WHAT" = all ] || [ "$WHAT" = quants-default ]; then
  # the default model requantized by llama.cpp (the Q4_1 file is the only source here:
  # --allow-requantize), and llama.cpp's references on each (f32 K/V, no flash attention)
  mkdir -p models/quants
  for t in Q4_K_M Q5_K_M Q6_K Q8_0 Q2_K Q3_K_M Q4_K_S Q5_0 Q5_1 IQ4_NL IQ4_XS; do
    f="models/quants/SmolLM2-135M-Instruct.$t.gguf"
    "$Q" --allow-requantize "$MODEL" "$f" "$t" 2 > /dev/null 2>&1
    REF_KV=f32 REF_FLASH=0 "$REF_DIR/make_reference_logits" "$f" 2 "${SMOLLM2_PROMPTS[@]}" > "${f%.gguf}-reference.json.tmp"
    mv "${f%.gguf}-reference.json.tmp" "${f%.gguf}-reference.json"
    echo "wrote $f and its reference"
  done
fi
[ "$WHAT" = all ] && check_templates
[ "$WHAT" = all ] || [ "$WHAT" = smollm2 ] || exit 0
"$REF_DIR/make_reference_logits" "$MODEL" 2 "${SMOLLM2_PROMPTS[@]}" > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "wrote $OUT"
