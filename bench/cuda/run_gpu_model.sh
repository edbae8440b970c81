#!/usr/bin/env bash
# One device call for the GPU forward (src/gpu): its test against the CPU
# forward and against itself (tests/cuda/test_gpu_model.c), the comparison
# with Hugging Face transformers on the same GPU in f32 and bf16
# (tests/cuda/check_gpu_transformers.py through tests/cuda/gpu_logits.c), and
# compute-sanitizer memcheck on the test; logs and JSON under $OUT.
#
# Built here (make CUDA=1 BUILD=build-cuda ...), carried in .devcarry:
#   .devcarry/{test_gpu_model,gpu_logits,test_engine,cascade}.xz (xz: the kernels' fat binaries
#   shrink about 5x), .devcarry/lib (../shared/tools/carry-libs),
#   .devcarry/model.gguf (tools/truncate_gguf.py: the default model's first
#   layers, what fits a call's 64 MiB), .devcarry/.whl (gguf for transformers)
#   (.devcarry/lib.tar.xz instead of lib/: the libraries packed)
#   .devcarry/test_gpu_tp.xz for the tp step
# Usage: bash bench/cuda/run_gpu_model.sh [steps...]  (test engine hf generate bench synthetic memcheck anchor trace e2e
#   prefill tp tpbench)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-"test engine hf generate bench synthetic memcheck"}
has() { [[ " $steps " == *" $1 "* ]]; }
C=${CARRY:-.devcarry}
B=/tmp/cascade-bin; mkdir -p "$B/tests"
W=/tmp/cascade-work; mkdir -p "$W"
for f in "$C"/*.xz; do
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "$B/$(basename "$f" .xz)"
  chmod +x "$B/$(basename "$f" .xz)"
done
[ -f "$B/test_engine" ] && mv "$B/test_engine" "$B/tests/"
[ -f "$C/lib.tar.xz" ] && python3 -c 'import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$C/lib.tar.xz" "$B"
export LD_LIBRARY_PATH=$B/lib:$PWD/$C/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
M=$C/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ldd "$B/test_gpu_model" | grep "not found" && echo "missing libraries"

# collect PREFIX OUT: every $W/PREFIX*.json into one JSON at OUT (name -> run), and a line per run
collect() {
  python3 - "$W" "$1" "$2" <<'PY'
import glob, json, os, sys
w, prefix, out = sys.argv[1], sys.argv[2], sys.argv[3]
runs = {}
for f in sorted(glob.glob(f"{w}/{prefix}*.json")):
    name = os.path.basename(f)[len(prefix):-5]
    try:
        runs[name] = json.load(open(f))
    except Exception as e:
        runs[name] = {"error": str(e)}
json.dump(runs, open(out, "w"), indent=1)
for k, d in runs.items():
    print(f"{k:22s} " + " ".join(f"{x} {d.get(x)}" for x in ("output_tok_per_s", "tpot_ms_p50", "ttft_ms_p50",
          "decode_step_ms_p50", "steps", "cascade_steps", "graph_steps", "eager_steps")))
PY
}

if has test; then
  echo "== test_gpu_model"
  timeout 180 "$B/test_gpu_model" "$M" 2>&1 | grep -vE "^ok"
fi
if has engine && [ -x "$B/tests/test_engine" ]; then
  echo "== the engine's tests on the GPU (tests/cuda/engine_on_gpu.sh)"
  BUILD=$B timeout 180 bash tests/cuda/engine_on_gpu.sh "$M" 2>&1 | grep -vE "^ok"
fi
if has tp; then
  echo "== tensor parallelism: the engine's tests through the split path (one rank, NCCL), and the synthetic 8B"
  echo "   shape split 1, 2, 4, 8 ways on the devices there are (tests/cuda/test_gpu_tp.c)"
  [ "${TP_ENGINE:-1}" = 1 ] && BUILD=$B timeout 240 bash tests/cuda/engine_on_gpu.sh --tensor-parallel 1 "$M" 2>&1 | grep -vE "^ok"
  [ -x "$B/test_gpu_tp" ] && timeout 300 "$B/test_gpu_tp" 2>&1 | grep -vE "^ok"
fi
if has tpbench && [ -x "$B/cascade" ]; then
  echo "== synthetic Llama-3-8B: decode steps without tensor parallelism and through its path with one rank"
  mkdir -p models; [ -e models/SmolLM2-135M-Instruct.Q4_1.gguf ] || ln -s "../$M" models/SmolLM2-135M-Instruct.Q4_1.gguf
  n=$(nvidia-smi -L | wc -l)
  for tp in 0 1 $( [ "$n" -ge 2 ] && echo 2 ) $( [ "$n" -ge 4 ] && echo 4 ) $( [ "$n" -ge 8 ] && echo 8 ); do
    a=; [ $tp -gt 0 ] && a="--tensor-parallel $tp"
    for b in ${TP_BATCHES:-1 64}; do
      timeout 90 "$B/cascade" bench -m synthetic:llama-3-8b --device cuda --requests $b --prefix 0 --suffix 128 --output 64 \
        $a --json > "$W/tp_${tp}_b$b.json" 2> "$W/tp_${tp}_b$b.err"; echo "tp $tp batch $b rc=$? $(tail -1 "$W/tp_${tp}_b$b.err")"
    done
    for c in ${TP_SP_MODES-"" --no-cascade}; do
      timeout 120 "$B/cascade" bench -m synthetic:llama-3-8b --device cuda --workload system-prompt --scale ${TP_SCALE:-0.5} \
        --max-batch-tokens 2048 $a $c --json > "$W/tp_${tp}_sp$c.json" 2> "$W/tp_${tp}_sp$c.err"
      echo "tp $tp system-prompt $c rc=$? $(tail -1 "$W/tp_${tp}_sp$c.err")"
    done
  done
  collect tp_ "$OUT/tp-llama-3-8b.json"
fi
if has hf; then
  echo "== transformers"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$C"/.whl/*.whl \
    && export PYTHONPATH=/tmp/site
  PYTHONUNBUFFERED=1 timeout 240 python3 tests/cuda/check_gpu_transformers.py --model "$M" --bin "$B/gpu_logits" \
    --json "$OUT/gpu-vs-transformers.json" 2>&1 | grep -v "it/s\]"
fi
if has generate && [ -x "$B/cascade" ]; then
  echo "== cascade generate, greedy, --device cuda against --device cpu"
  for d in cuda cpu; do
    timeout 60 "$B/cascade" generate -m "$M" --device $d --temperature 0 -n 32 -p "The capital of France is" \
      -p "def fibonacci(n):" -p "Once upon a time" > "$W/generate_$d.txt" 2> "$W/generate_$d.err"
    echo "$d rc=$? $(head -1 "$W/generate_$d.err")"; tail -2 "$W/generate_$d.err"
  done
  cmp -s "$W/generate_cuda.txt" "$W/generate_cpu.txt" && echo "generate: same text" || { echo "generate: texts differ"; diff "$W/generate_cuda.txt" "$W/generate_cpu.txt" | head -20; }
  cat "$W/generate_cuda.txt"
  for r in a b; do
    timeout 60 "$B/cascade" generate -m "$M" --device cuda --temperature 0.8 --seed 7 -n 24 -p "Once upon a time" -p "Once upon a time" > "$W/sample_$r.txt" 2>/dev/null
  done
  cmp -s "$W/sample_a.txt" "$W/sample_b.txt" && echo "sampling: same seed, same text" || echo "sampling: runs differ"
fi
if has bench && [ -x "$B/cascade" ]; then
  echo "== cascade bench --device cuda (the truncated model: launch-bound figures)"
  for d in cuda cpu; do
    timeout 90 "$B/cascade" bench -m "$M" --device $d --requests 16 --prefix 512 --suffix 16 --output 32 --json \
      > "$OUT/bench_$d.json" 2> "$W/bench_$d.err"; echo "$d rc=$?"; tail -3 "$W/bench_$d.err"
  done
fi
if has synthetic && [ -x "$B/cascade" ]; then
  echo "== synthetic Llama-3-8B shape (random bf16 weights): decode at batch 1, 16, 64; a shared prefix with and without cascade"
  mkdir -p models; [ -e models/SmolLM2-135M-Instruct.Q4_1.gguf ] || ln -s "../$M" models/SmolLM2-135M-Instruct.Q4_1.gguf
  for b in ${SYN_BATCHES:-1 16 64}; do
    timeout 90 "$B/cascade" bench -m synthetic:llama-3-8b --device cuda --requests $b --prefix 0 --suffix 128 --output 64 \
      --json > "$W/syn_b$b.json" 2> "$W/syn_b$b.err"; echo "batch $b rc=$? $(tail -1 "$W/syn_b$b.err")"
  done
  for b in ${SYN_EAGER_BATCHES:-1 64}; do
    timeout 90 "$B/cascade" bench -m synthetic:llama-3-8b --device cuda --requests $b --prefix 0 --suffix 128 --output 64 \
      --enforce-eager --json > "$W/syn_b${b}_eager.json" 2> "$W/syn_b${b}_eager.err"; echo "batch $b eager rc=$? $(tail -1 "$W/syn_b${b}_eager.err")"
  done
  for c in "" --no-cascade; do
    timeout 90 "$B/cascade" bench -m synthetic:llama-3-8b --device cuda --requests 64 --prefix 4096 --suffix 64 --output 64 $c \
      --json > "$W/syn_shared$c.json" 2> "$W/syn_shared$c.err"; echo "shared $c rc=$? $(tail -1 "$W/syn_shared$c.err")"
  done
  collect syn_ "$OUT/synthetic-llama-3-8b.json"
fi
if has memcheck; then
  echo "== compute-sanitizer memcheck on test_gpu_model"
  timeout ${MEMCHECK_S:-200} compute-sanitizer --tool memcheck --leak-check no "$B/test_gpu_model" "$M" > "$W/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed, |^FAIL|=====" "$W/memcheck.log" | head -30
fi
if has anchor && [ -f "$C/torch_e2e_anchor.py" ]; then
  echo "== the PyTorch peer (../shared/anchors/torch_e2e_anchor.py, carried): the 8B step as one CUDA graph"
  OUT=$OUT timeout ${ANCHOR_S:-150} python3 "$C/torch_e2e_anchor.py" 2>&1 | tail -25
fi
if has trace && [ -f "$C/libcas_cuda_trace.so" ]; then
  echo "== GPU idle share of a decode step (CUPTI activity records through tools/cuda_trace.c), graphs and eager"
  mkdir -p models; [ -e models/SmolLM2-135M-Instruct.Q4_1.gguf ] || ln -s "../$M" models/SmolLM2-135M-Instruct.Q4_1.gguf
  for g in ${TRACE_MODES:-graphs eager}; do
    for b in ${TRACE_BATCHES:-1 16 64}; do
      ex=; [ $g = eager ] && ex=--enforce-eager
      CUDA_INJECTION64_PATH=$PWD/$C/libcas_cuda_trace.so CAS_TRACE_OUT=$W/trace_${g}_b$b.csv timeout 90 "$B/cascade" bench \
        -m synthetic:llama-3-8b --device cuda --requests $b --prefix 0 --suffix 64 --output 40 $ex --json \
        > "$W/trace_${g}_b$b.json" 2> "$W/trace_${g}_b$b.err"
      echo "$g batch $b rc=$?"
      python3 tools/cuda_idle.py "$W/trace_${g}_b$b.csv" --last 30 --json "$OUT/idle_${g}_b$b.json" > "$W/idle_${g}_b$b.txt" 2>&1
      head -${TRACE_LINES:-8} "$W/idle_${g}_b$b.txt"
    done
  done
fi
if has prefill && [ -x "$B/cascade" ]; then
  echo "== prefill of one 8192-token prompt (TTFT of a lone request, one chunk)"
  timeout 90 "$B/cascade" bench -m synthetic:llama-3-8b --device cuda --requests 1 --prefix 0 --suffix 8192 --output 2 \
    --max-batch-tokens 8192 --json > "$OUT/prefill-8192.json" 2> "$W/prefill.err"; echo "rc=$?"; cat "$OUT/prefill-8192.json"; tail -2 "$W/prefill.err"
fi
if has e2e && [ -x "$B/cascade" ]; then
  echo "== end-to-end workloads (bench/cuda/e2e_bench.sh)"
  CASCADE=$B/cascade OUT=$OUT/e2e TOKENIZER_GGUF=$M WORKLOADS="${E2E_WORKLOADS:-system-prompt}" MODES="${E2E_MODES:-cascade prefix}" \
    DEADLINE=${E2E_S:-150} EXTRA_ARGS="${E2E_ARGS:---max-batch-tokens 2048}" bash bench/cuda/e2e_bench.sh ${E2E_RUN_S:-100} 2>&1 | tail -20
fi
