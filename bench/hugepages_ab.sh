#!/usr/bin/env bash
# The CPU model's weights read into huge pages (the default) against the
# file's 4 KiB-page mapping (--mmap): bench/model_bench on the same files, the
# two alternating, ROUNDS rounds, each round's numbers and the read bandwidth
# measured in the same runs. Writes bench/results/cpu-weights-hugepages.json.
#   usage: bash bench/hugepages_ab.sh [THREADS]   (env: TYPES, ROUNDS)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
ROUNDS=${ROUNDS:-4}
TYPES=${TYPES:-"Q8_0 Q6_K Q4_K_M"}
for t in $TYPES; do
  [ -f "models/quants/SmolLM2-135M-Instruct.$t.gguf" ] || { WHAT=quants-default bash tools/make_reference_logits.sh > /dev/null; break; }
done
BUILD=${BUILD:-build}
make -s BUILD="$BUILD" -j"$(nproc)" "$BUILD/libcascade.a"
LIBS=$(pkg-config --libs libpcre2-8 libxxhash jansson libmicrohttpd 2>/dev/null || true)
cc -std=c11 -O2 -fopenmp -D_GNU_SOURCE -o "$BUILD/model_bench" bench/model_bench.c "$BUILD/libcascade.a" \
  $LIBS -lm -lpthread
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
for r in $(seq "$ROUNDS"); do
  for t in $TYPES; do
    for mode in huge mmap; do
      OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=active "$BUILD/model_bench" "models/quants/SmolLM2-135M-Instruct.$t.gguf" \
        "$THREADS" 32 $([ "$mode" = mmap ] && echo --mmap) > "$W/$t-$mode-$r.json"
    done
  done
done
mkdir -p bench/results
python3 - "$W" "$ROUNDS" "$THREADS" "$TYPES" > bench/results/cpu-weights-hugepages.json <<'PY'
import json, statistics, sys
w, rounds, threads, types = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
out = {"what": "bench/model_bench with the weights read into huge pages (default) and in the file's mapping (--mmap), "
               "alternating; tok/s per round", "cpu": cpu, "threads": threads, "rounds": rounds, "files": []}
for t in types:
    e = {"type": t}
    for mode in ("huge", "mmap"):
        runs = [json.load(open(f"{w}/{t}-{mode}-{r}.json")) for r in range(1, rounds + 1)]
        e[mode] = {"decode": [x["single"]["decode_tokens_per_s"] for x in runs],
                   "prefill": [x["single"]["prefill_tokens_per_s"] for x in runs],
                   "decode_32": [x["batch"]["decode_tokens_per_s"] for x in runs],
                   "read_bandwidth_gbs": [x["read_bandwidth_gbs"] for x in runs],
                   "decode_roofline_tokens_per_s": [x["decode_roofline_tokens_per_s"] for x in runs]}
    e["decode_median_ratio"] = round(statistics.median(e["huge"]["decode"]) / statistics.median(e["mmap"]["decode"]), 3)
    e["decode_32_median_ratio"] = round(statistics.median(e["huge"]["decode_32"]) / statistics.median(e["mmap"]["decode_32"]), 3)
    out["files"].append(e)
print(json.dumps(out, indent=1))
PY
python3 -c "
import json; d=json.load(open('bench/results/cpu-weights-hugepages.json'))
for e in d['files']: print(e['type'], 'decode huge', e['huge']['decode'], 'mmap', e['mmap']['decode'], 'median ratio', e['decode_median_ratio'], '32-seq', e['decode_32_median_ratio'])"
