#!/usr/bin/env bash
# Runs the CPU attention core on the device machine's host CPU (AVX-512):
# builds the core and attn layers alone (that host lacks PCRE2 for the model
# layer), runs the attention tests with the AVX-512 kernel, and times
# attn-bench pinned to 2 cores and on all cores. Output: $OUT/cpu-*.json.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/cb
CF="-std=c11 -O2 -g -fopenmp -ffp-contract=fast -D_GNU_SOURCE"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
for f in src/core/core.c src/core/core_measure.c src/attn/attn_ref.c src/attn/attn_plan.c src/attn/attn_cpu.c \
         src/attn/attn_synth.c src/attn/attn_calib.c; do
  gcc $CF -c "$f" -o "/tmp/cb/$(basename "$f" .c).o"
done
AVX2="-mavx2 -mfma -mf16c"
AVX512="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c"
for f in src/core/core_measure_avx2.c src/attn/attn_cpu_avx2.c; do
  gcc $CF $AVX2 -c "$f" -o "/tmp/cb/$(basename "$f" .c).o"
done
for f in src/core/core_measure_avx512.c src/attn/attn_cpu_avx512.c; do
  gcc $CF $AVX512 -c "$f" -o "/tmp/cb/$(basename "$f" .c).o"
done
gcc $CF $AVX512 -mavx512bf16 -mamx-tile -mamx-bf16 -c src/attn/attn_cpu_avx512bf16.c -o /tmp/cb/avx512bf16.o
gcc $CF -Itests tests/test_attn.c /tmp/cb/*.o -lm -o /tmp/cb/test_attn
printf 'int cmd_attn_bench(int, char **);\nint main(int c, char **v) { return cmd_attn_bench(c, v); }\n' > /tmp/cb/main.c
gcc $CF /tmp/cb/main.c src/tools/cmd_attn_bench.c /tmp/cb/*.o -lm -o /tmp/cb/attn-bench
/tmp/cb/test_attn | tail -12 | tee "$OUT/cpu-test.txt"
B=/tmp/cb/attn-bench
common="--heads 32:8 --head-dim 128 --page-size 16 --repeats 5 --check 4 --json"
{
for simd in avx512 avx2; do
  taskset -c 0,1 $B --simd $simd --threads 2 $common --batch 32 --prefix 8192 --suffix 256 --dtype f32
  taskset -c 0,1 $B --simd $simd --threads 2 $common --batch 32 --prefix 8192 --suffix 256 --dtype bf16
  taskset -c 0,1 $B --simd $simd --threads 2 $common --batch 32 --prefix 0 --suffix 4096 --dtype f32
  taskset -c 0,1 $B --simd $simd --threads 2 $common --batch 1 --prefix 0 --suffix 65536 --dtype f32
done
$B $common --batch 32 --prefix 8192 --suffix 256 --dtype f32
$B $common --batch 32 --prefix 0 --suffix 4096 --dtype f32
} | tee "$OUT/cpu-bench.jsonl"
python3 - "$OUT/cpu-bench.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"{r['simd']:7} t={r['threads']:2} B={r['batch']:3} P={r['prefix']:5} S={r['suffix']:5} {r['dtype']:5} "
          f"flat {r['flat_ms']:8.2f} ms {r['flat_GBps']:6.1f}/{r['peak_GBps']:6.1f} GB/s | cascade {r['cascade_ms']:8.2f} ms "
          f"{r['cascade_GFLOPs']:7.1f}/{r['peak_GFLOPs']:7.1f} GF/s | x{r['speedup']:.2f} err {r['max_rel_err_cascade']:.1e}")
PY
