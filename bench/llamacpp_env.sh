# Sourced by bench/vs_llamacpp.sh and bench/seqs_sweep.sh (from the repository
# root, THREADS and TYPES set): the GGUF files of each type (the default model
# and its requantizations by llama.cpp's llama-quantize, WHAT=quants-default
# of tools/make_reference_logits.sh, made when missing), llama.cpp's
# llama-bench and llama-batched-bench built from the source the reference
# fixtures use (the llama-cpp-python sdist, cmake Release, native, its OpenMP
# threads, in a directory of its own), and bench/model_bench.c built against
# this tree's library as $BUILD/model_bench.
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
COMMIT=$(git -C "$L" rev-parse HEAD 2> /dev/null || echo "llama-cpp-python $VER")
BUILD=${BUILD:-build}
LIBS=$(pkg-config --libs libpcre2-8 libxxhash jansson libmicrohttpd 2>/dev/null || true)
make -s BUILD="$BUILD" -j"$(nproc)" "$BUILD/libcascade.a"
cc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -o "$BUILD/model_bench" bench/model_bench.c "$BUILD/libcascade.a" \
  $LIBS -lm -lpthread
