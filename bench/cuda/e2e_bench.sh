#!/usr/bin/env bash
# End-to-end workloads through the engine, for one device call: every
# `cascade bench --workload` preset on the synthetic Llama-3-8B shape in three
# modes, each its own process under `timeout`:
#   cascade  cascade attention + prefix cache (the defaults)
#   prefix   prefix cache only (--no-cascade)
#   none     neither (--no-cascade --no-prefix-cache)
# One JSON line per run is appended to $OUT/e2e.jsonl with "mode" added; a run
# that fails or times out appends {"workload", "mode", "error"} instead and
# the rest go on. Each run also writes $OUT/steps-WORKLOAD-MODE.json (every
# step: time, batch, KV tokens read) and $OUT/latency-WORKLOAD-MODE.json
# (TTFT per request, inter-token latencies) for bench/e2e_plot.py, and its
# stderr to $OUT/log-WORKLOAD-MODE.txt. A table of the runs ends the output.
#
# The roofline needs the device's copy bandwidth: the first CUDA run measures
# it (--measure-copy) and the later runs take that figure (--copy-gbps), so
# every run's roofline uses the same one; COPY_GBPS gives it instead.
#
# KV memory: an H100 80 GB holds the 16 GB of Llama-3-8B weights and about
# 55 GB of KV at 128 KiB per token, some 450k tokens. system-prompt without
# the prefix cache needs 64 * 8704 = 557k tokens at once: the engine then
# queues requests until others finish (it still runs, with smaller batches).
# long-context raises the context past the model's 8192 (bench does that for
# the longest request; random weights have no trained context to exceed).
#
# A synthetic model takes the default model's tokenizer from
# models/SmolLM2-135M-Instruct.Q4_1.gguf; when that is missing and
# TOKENIZER_GGUF names a GGUF file with the same vocabulary (a truncated
# copy: tools/truncate_gguf.py), it is linked there.
#
# Usage: bash bench/cuda/e2e_bench.sh [PER_RUN_LIMIT_S]
# Environment (defaults):
#   CASCADE=build-cuda/cascade  OUT=/tmp/out  MODEL=synthetic:llama-3-8b  DEVICE=cuda
#   WORKLOADS="system-prompt few-shot-tree document-qa parallel-sampling unshared long-context"
#   MODES="cascade prefix none"  SCALE=1  RUN_LIMIT=120 (the argument wins)
#   DEADLINE=0 (seconds for the whole script; runs that would start later are
#   recorded as skipped; 0: none)  COPY_GBPS=  EXTRA_ARGS= (more bench options)
# CPU check: CASCADE=./build/cascade DEVICE=cpu MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf SCALE=0.01
set -u
CASCADE=${CASCADE:-build-cuda/cascade}
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-synthetic:llama-3-8b}
DEVICE=${DEVICE:-cuda}
WORKLOADS=${WORKLOADS:-"system-prompt few-shot-tree document-qa parallel-sampling unshared long-context"}
MODES=${MODES:-"cascade prefix none"}
SCALE=${SCALE:-1}
LIMIT=${1:-${RUN_LIMIT:-120}}
DEADLINE=${DEADLINE:-0}
COPY_GBPS=${COPY_GBPS:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
mkdir -p "$OUT"
JSONL=$OUT/e2e.jsonl

if [ ! -x "$CASCADE" ]; then
  echo "e2e: no executable cascade at $CASCADE (set CASCADE)" >&2
  exit 1
fi
if [[ $MODEL == synthetic:* ]] && [ ! -e models/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -n "${TOKENIZER_GGUF:-}" ]; then
  mkdir -p models && ln -s "$(realpath "$TOKENIZER_GGUF")" models/SmolLM2-135M-Instruct.Q4_1.gguf
fi
command -v nvidia-smi > /dev/null && [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

mode_flags() {
  case $1 in
    cascade) echo "" ;;
    prefix) echo "--no-cascade" ;;
    none) echo "--no-cascade --no-prefix-cache" ;;
    *) return 1 ;;
  esac
}

# a JSON string's contents: backslashes and quotes escaped, control characters dropped
json_escape() { printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g'; }

record_error() { # workload mode message
  printf '{"workload": "%s", "mode": "%s", "scale": %s, "error": "%s"}\n' "$1" "$2" "$SCALE" "$(json_escape "$3")" >> "$JSONL"
  echo "e2e: $1 $2: $3" >&2
}

start=$(date +%s)
for w in $WORKLOADS; do
  for m in $MODES; do
    if ! flags=$(mode_flags "$m"); then
      record_error "$w" "$m" "unknown mode (cascade, prefix, none)"
      continue
    fi
    if [ "$DEADLINE" -gt 0 ] && [ $(( $(date +%s) - start )) -ge "$DEADLINE" ]; then
      record_error "$w" "$m" "skipped: past the script's deadline of $DEADLINE s"
      continue
    fi
    if [ -n "$COPY_GBPS" ]; then copy="--copy-gbps $COPY_GBPS"
    elif [ "$DEVICE" = cuda ]; then copy="--measure-copy"
    else copy=""
    fi
    tag=$w-$m
    log=$OUT/log-$tag.txt
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086 # flags, copy and EXTRA_ARGS are lists of options
    timeout "$LIMIT" "$CASCADE" bench -m "$MODEL" --device "$DEVICE" --workload "$w" --scale "$SCALE" \
      $flags $copy $EXTRA_ARGS --label "$m" --json \
      --steps-json "$OUT/steps-$tag.json" --latency-json "$OUT/latency-$tag.json" \
      > "$OUT/.run.out" 2> "$log"
    rc=$?
    line=$(tail -n 1 "$OUT/.run.out")
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ $rc -eq 0 ] && [[ $line == "{"* ]]; then
      echo "{\"mode\": \"$m\", ${line#\{}" >> "$JSONL"
      echo "e2e: $w $m: done in $secs s"
      if [ -z "$COPY_GBPS" ] && [ "$DEVICE" = cuda ]; then
        g=$(printf '%s' "$line" | grep -o '"copy_gbps": [0-9.]*' | awk '{ print $2 }')
        [ -n "$g" ] && COPY_GBPS=$g && echo "e2e: copy bandwidth $g GB/s, used by the later runs"
      fi
    elif [ $rc -eq 124 ]; then
      record_error "$w" "$m" "timed out after $LIMIT s ($(tail -n 1 "$log"))"
    else
      record_error "$w" "$m" "exit $rc: $(grep -v '^bench: device copy' "$log" | tail -n 1)"
    fi
  done
done
rm -f "$OUT/.run.out"

# the table: this call's runs (the last line per workload and mode)
python3 - "$JSONL" "$WORKLOADS" "$MODES" <<'PY' || cat "$JSONL"
import json, sys
path, workloads, modes = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
last = {}
for ln in open(path):
    try:
        r = json.loads(ln)
    except ValueError:
        continue
    last[(r.get("workload"), r.get("mode"))] = r
def f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(int(fmt.split(".")[0]))
print(f"{'workload':18s} {'mode':8s} {'out tok/s':>10s} {'decode ms':>10s} {'roofline':>9s} {'ratio':>6s} {'TTFT p50':>10s}")
for w in workloads:
    for m in modes:
        r = last.get((w, m))
        if r is None:
            continue
        if "error" in r:
            print(f"{w:18s} {m:8s} error: {r['error'][:70]}")
            continue
        print(f"{w:18s} {m:8s} {f(r.get('output_tok_per_s'), '10.1f')} {f(r.get('decode_step_ms_p50'), '10.3f')} "
              f"{f(r.get('roofline_ms_median'), '9.3f')} {f(r.get('step_over_roofline'), '6.2f')} "
              f"{f(r.get('ttft_ms_p50'), '10.1f')}")
PY
