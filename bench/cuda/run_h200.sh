#!/usr/bin/env bash
# One device call on the H200: run the CUDA backend's tests against the
# float64 reference, compute-sanitizer on small cases, and the benchmarks
# (JSON and logs under $OUT), printing a short summary last.
#
# Binaries: built here (make CUDA=1) unless a folder of prebuilt ones is
# carried (CARRY=.devcarry: cascade, test_cuda_attn, attn_bench_cuda and the
# shared libraries the GPU image lacks: pcre2, jansson, microhttpd, xxhash),
# which saves the nvcc time of the device lease; see bench/NOTES.md.
# Usage: bash bench/cuda/run_h200.sh [steps...]
#   steps: test bench diag bench2 fuse ab pf dec tl cli ncupf ncu ncudec grid sanitize (default: test bench cli grid)
#   (dec: DEC_CASES, DEC_WIDE, DEC_AB, DEC_ROUNDS, DEC_RESERVE; tl: TL_RUNS; ncudec:
#   NCUDEC_VARIANTS, NCUDEC_CASE; see the steps)
#   env: BENCH_KINDS (many-rows kernel kinds benchmarked, default "17 9 11 6 8 3 1"),
#   DIAG_KINDS (warp-specialized kinds timed with CASCADE_CUDA_WS_DIAG=1: no K/V copies),
#   CASCADE_TEST_KINDS (kinds tested), GRID_WIDE (kind for the grid), NCU_WIDE,
#   SANITIZE_KINDS (kinds under compute-sanitizer), FUSE_CHUNKS, FUSE_CASES (step fuse:
#   cases as P,B,U separated by spaces),
#   GRID_AB (a kind the grid also times each cascade with; 9 when the grid runs 11),
#   GRID_RESERVE (seconds the grid leaves for the steps after it),
#   CASCADE_BENCH_AB (a second kind the grid times each cascade with, same run),
#   AB_CASES, OLD_BB, AB_WIDE (step ab: cases P,B,U timed with this build and with the
#   attn_bench_cuda at OLD_BB, default $CARRY/old_attn_bench_cuda, alternating)
# The grid runs with the many-rows kernel kind that was fastest in `bench`
# among those whose tests passed (or GRID_WIDE).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# at most 8 files come back from the device tool: the small ones go into all.tgz
W=/tmp/cascade-h200; rm -rf "$W"; mkdir -p "$W"
steps=${*:-"test bench cli grid"}
has() { [[ " $steps " == *" $1 "* ]]; }
DEADLINE=${DEADLINE:-560}   # seconds; the device tool stops a command at 600
left() { echo $((DEADLINE - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$W/gpu.txt"
CARRY=${CARRY:-.devcarry}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
T= ; BB= ; CAS=
if [ -x "$CARRY/test_cuda_attn" ]; then
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$PWD/$CARRY/lib
  for b in "$CARRY"/cascade "$CARRY"/test_cuda_attn; do
    [ -x "$b" ] && ldd "$b" | grep -q "not found" && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$PWD/$CARRY/lib2
  done
  T=$CARRY/test_cuda_attn; BB=$CARRY/attn_bench_cuda; CAS=$CARRY/cascade; [ -x "$CAS" ] || CAS=
  ldd "$T" | grep "not found"
  ldd "$T" | grep -q "not found" && T=
fi
if [ -z "$T" ]; then
  echo "== building here"
  B=build-h200
  ( make -j16 CUDA=1 BUILD=$B cuda-build-check ) > "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
  T=$B/tests/cuda/test_cuda_attn; BB=$B/bench/cuda/attn_bench_cuda; CAS=
fi
command -v cuobjdump >/dev/null && cuobjdump --dump-sass "$T" > "$W/sass.txt" 2>/dev/null &&
  echo "in the test binary: HGMMA $(grep -c HGMMA "$W/sass.txt"), UTMALDG $(grep -c UTMALDG "$W/sass.txt")"
if has test; then
  export CASCADE_TEST_KINDS=${CASCADE_TEST_KINDS:-18,17,11,9,6,3,5,1}; echo "== test-cuda (kinds $CASCADE_TEST_KINDS)"
  timeout ${TEST_TIMEOUT:-200} "$T" > "$W/test_cuda.log" 2>&1; echo "test rc=$?"
  grep -E "^(FAIL|ok|==|skip)|passed" "$W/test_cuda.log" | tail -30
fi
if has bench; then
  BENCH_KINDS=${BENCH_KINDS:-17 9 11 6 8 3 1}
  echo "== bench: headline, B256 and prefill, kinds $BENCH_KINDS (17 wgmma-ws-tma-mix, 11 wgmma-ws-tma-tails, 9 wgmma-ws-tma, 6 wgmma-ws, 7 wgmma-ws64, 8 wgmma-ws-overlap, 3 wgmma, 4 wgmma-overlap, 1 mma.sync); split rule off (s0)"
  for k in $BENCH_KINDS; do
    CASCADE_CUDA_WIDE=$k timeout 60 "$BB" --batch 64 --prefix 32768 --suffix 512 --json "$W/one_k$k.json" 2>&1 | tail -1 | sed "s/^/k$k /"
    CASCADE_CUDA_WIDE=$k timeout 60 "$BB" --batch 256 --prefix 32768 --suffix 512 --json "$W/b256_k$k.json" 2>&1 | tail -1 | sed "s/^/k$k /"
    CASCADE_CUDA_WIDE=$k timeout 60 "$BB" --unshared --prefill 16384 --json "$W/up_k$k.json" 2>&1 | grep -E "unshared|prefill" | sed "s/^/k$k /"
  done
  [ -n "${BENCH_S0:-}" ] && CASCADE_CUDA_SPLIT=0 CASCADE_CUDA_WIDE=3 timeout 60 "$BB" --batch 64 --prefix 32768 --suffix 512 --json "$W/one_k3_s0.json" 2>&1 | tail -1 | sed "s/^/k3 s0 /"
  # the kind for the grid: fastest headline + B256 cascade among kinds whose tests passed
  GRID_WIDE=$(python3 - "$W" "$BENCH_KINDS" <<'PY'
import json, re, sys, os
w, kinds = sys.argv[1], sys.argv[2].split()
log = open(os.path.join(w, "test_cuda.log")).read() if os.path.exists(os.path.join(w, "test_cuda.log")) else ""
bad, done = set(), set()
cur = None
for line in log.splitlines():
    m = re.search(r"CASCADE_CUDA_WIDE=(\d+)", line)
    if line.startswith("=="):
        cur = m.group(1) if m else None
    elif line.startswith("FAIL") and cur:
        bad.add(cur)
    elif line.startswith("ok test_graph_replan") and cur:
        done.add(cur)
bad |= set(kinds) - done
best, bt = "1", 1e9
for k in kinds:
    try:
        t = sum(json.load(open(os.path.join(w, f))).get("cases", [{}])[0]["cascade_ms"] for f in ("one_k%s.json" % k, "b256_k%s.json" % k))
    except Exception:
        continue
    if (k in bad) or (not log):
        continue
    if t < bt:
        best, bt = k, t
print(best)
PY
)
  echo "kind for the grid: $GRID_WIDE"
fi
if has diag; then
  echo "== consumers alone (CASCADE_CUDA_WS_DIAG=1: the producer copies nothing; timing only), kinds ${DIAG_KINDS:-9 6}"
  for k in ${DIAG_KINDS:-9 6}; do
    CASCADE_CUDA_WS_DIAG=1 CASCADE_CUDA_WIDE=$k timeout 60 "$BB" --batch 64 --prefix 32768 --suffix 512 --json "$W/diag_one_k$k.json" 2>&1 | tail -1 | sed "s/^/diag k$k /"
    CASCADE_CUDA_WS_DIAG=1 CASCADE_CUDA_WIDE=$k timeout 60 "$BB" --unshared --prefill 16384 --json "$W/diag_up_k$k.json" 2>&1 | grep -E "prefill" | sed "s/^/diag k$k /"
  done
fi
if has bench2; then
  echo "== split rule 1 (chunks >= 512 keys) vs 2 (>= 128) on small shared passes, wgmma"
  for c in "1024 16 512" "4096 16 512" "4096 64 128" "32768 64 512"; do set -- $c
    for r in 1 2; do
      CASCADE_CUDA_SPLIT=$r timeout 60 "$BB" --prefix $1 --batch $2 --suffix $3 --json "$W/split${r}_$1_$2_$3.json" 2>&1 | tail -1 | sed "s/^/rule $r /"
    done
  done
fi
if has fuse; then
  echo "== kind 11 (tails on the spare producer warps) against kind 9 in the same process (ab_ms), fused chunk lengths"
  for ch in ${FUSE_CHUNKS:-128 256 512}; do
    CASCADE_CUDA_FUSE_CHUNK=$ch CASCADE_BENCH_AB=9 CASCADE_CUDA_WIDE=11 timeout 60 "$BB" --batch 64 --prefix 32768 --suffix 512 --json "$W/fuse_one_c$ch.json" 2>&1 | tail -1 | sed "s/^/chunk $ch /"
    grep -o '"cascade_ab_ms[^,]*\|"fused_tasks[^,]*' "$W/fuse_one_c$ch.json" | tr '\n' ' '; echo
  done
  for c in ${FUSE_CASES:-1024,8,128 1024,64,512 4096,16,512 16384,64,2048 16384,256,512 32768,16,512 32768,128,128 32768,256,2048}; do
    IFS=, read -r p1 p2 p3 <<< "$c"; set -- "$p1" "$p2" "$p3"
    CASCADE_BENCH_AB=9 CASCADE_CUDA_WIDE=11 timeout 60 "$BB" --prefix $1 --batch $2 --suffix $3 --json "$W/fuse_$1_$2_$3.json" 2>&1 | tail -1 | sed "s/^/k11 vs k9 /"
    grep -o '"cascade_ab_ms[^,]*\|"fused_tasks[^,]*' "$W/fuse_$1_$2_$3.json" | tr '\n' ' '; echo
  done
fi
if has ab && [ -x "${OLD_BB:-$CARRY/old_attn_bench_cuda}" ]; then
  OB=${OLD_BB:-$CARRY/old_attn_bench_cuda}
  echo "== A/B: this tree's attn_bench_cuda (new) against $OB (old), alternating, kind ${AB_WIDE:-default}"
  for c in ${AB_CASES:-32768,64,512 16384,64,128 32768,64,2048 1024,16,512 4096,64,128 16384,256,512}; do
    IFS=, read -r p1 p2 p3 <<< "$c"
    for r in 1 2; do for v in new old; do
      b=$BB; [ $v = old ] && b=$OB
      CASCADE_CUDA_WIDE=${AB_WIDE:-} timeout 60 "$b" --prefix $p1 --batch $p2 --suffix $p3 --json "$W/ab_${v}_${p1}_${p2}_${p3}_$r.json" 2>&1 | tail -1 | sed "s/^/$v /"
    done; done
  done
  for v in new old; do
    b=$BB; [ $v = old ] && b=$OB
    CASCADE_CUDA_WIDE=${AB_WIDE:-} timeout 60 "$b" --unshared --json "$W/ab_${v}_unshared.json" 2>&1 | grep -E "unshared" | sed "s/^/$v /"
  done
fi
if has pf; then
  # prefill variants alternating in one call (the spread between calls is ~5%):
  # PF_VARIANTS entries name=ENV=VAL[,ENV=VAL] (binary old = OLD_BB), PF_ROUNDS
  # rounds; torch's SDPA (MHA 32 heads) after each round, and with PF_MHA ours
  # at 32:32 heads too; PF_DECODE cases P,B,U timed with each of PF_DECODE_KINDS
  OB=${OLD_BB:-$CARRY/old_attn_bench_cuda}
  echo "== prefill 16k causal, variants alternating (${PF_ROUNDS:-3} rounds)"
  # the SM clock, power and throttle reasons every 50 ms while they run
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 50 > "$OUT/pf_clocks.csv" 2>/dev/null &
  SMI=$!
  for r in $(seq 1 ${PF_ROUNDS:-3}); do
    for var in ${PF_VARIANTS:-k17=CASCADE_CUDA_WIDE=17}; do
      name=${var%%=*}; envs=${var#*=}; b=$BB; [ "${name#old}" != "$name" ] && b=$OB
      date +%T.%N | sed "s/^/$name r$r start /" >> "$OUT/pf_marks.txt"
      env $(echo "$envs" | tr , ' ') timeout 60 "$b" --prefill 16384 --iters ${PF_ITERS:-30} --json "$W/pf_${name}_$r.json" 2>&1 | grep -E "prefill" | sed "s/^/$name r$r /"
    done
    [ -n "${PF_TORCH-1}" ] && date +%T.%N | sed "s/^/round $r torch /" >> "$OUT/pf_marks.txt"
    [ -n "${PF_TORCH-1}" ] && timeout 120 python3 bench/cuda/torch_prefill.py 16384 2>&1 | tee -a "$OUT/torch_prefill.jsonl" | sed "s/^/torch r$r /"
    [ -n "${PF_MHA:-}" ] && CASCADE_CUDA_WIDE=9 timeout 60 "$BB" --heads 32:32 --prefill 16384 --json "$W/pf_mha_$r.json" 2>&1 | grep -E "prefill" | sed "s/^/k9 32:32 r$r /"
    date +%T.%N | sed "s/^/round $r ends /" >> "$OUT/pf_marks.txt"
  done
  for c in ${PF_DECODE:-}; do
    IFS=, read -r p1 p2 p3 <<< "$c"
    for r in 1 2; do for k in ${PF_DECODE_KINDS:-17 9}; do
      CASCADE_CUDA_WIDE=$k timeout 60 "$BB" --prefix $p1 --batch $p2 --suffix $p3 --json "$W/pfd_k${k}_${p1}_${p2}_${p3}_$r.json" 2>&1 | tail -1 | sed "s/^/k$k r$r /"
    done; done
  done
  kill $SMI 2>/dev/null
  python3 - "$OUT/pf_clocks.csv" <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 4]
busy = [r for r in rows if r[2].strip().replace(" W", "").replace(".", "").isdigit() and float(r[2].split()[0]) > 300]
if busy:
    mhz = sorted(int(r[1].split()[0]) for r in busy); w = sorted(float(r[2].split()[0]) for r in busy)
    print("clocks under load (samples > 300 W: %d of %d): SM %d-%d MHz, median %d; power median %.0f W, max %.0f W; throttle reasons seen: %s"
          % (len(busy), len(rows), mhz[0], mhz[-1], mhz[len(mhz) // 2], w[len(w) // 2], w[-1], sorted(set(r[4].strip() for r in busy))))
PY
fi
if has dec; then
  # decode cases P,B,U;... (DEC_CASES) in one process per round (DEC_ROUNDS),
  # the cascade timed with kind DEC_WIDE and each variant of DEC_AB
  # ("kind[:ENV=VAL,...];...", checked against the reference too)
  DEC_CASES=${DEC_CASES:-"32768,64,512;32768,256,512;16384,64,2048;16384,256,2048;16384,64,128;1024,8,128;4096,16,512"}
  for r in $(seq 1 ${DEC_ROUNDS:-1}); do
    echo "== decode cases, kind ${DEC_WIDE:-17} against ${DEC_AB:-9}, round $r, $(left) s left"
    CASCADE_BENCH_AB=${DEC_AB:-9} CASCADE_CUDA_WIDE=${DEC_WIDE:-17} timeout $(( $(left) - ${DEC_RESERVE:-20} )) "$BB" --cases "$DEC_CASES" --json "$OUT/dec_$r.json" 2>&1 | grep -E '^P |device' | sed "s/^/r$r /"
  done
fi
if has tl; then
  # timelines of the many-rows kernel (CASCADE_CUDA_XV=18: kind 17 with the
  # timeline): TL_RUNS entries name=P,B,U[,ENV=VAL...]; the last kind-17
  # run of each process is dumped and summarised (bench/cuda/timeline.py)
  for run in ${TL_RUNS:-"o1=32768,64,512 o3=32768,64,512,CASCADE_CUDA_TAIL_ORDER=3 b256=32768,256,512"}; do
    name=${run%%=*}; rest=${run#*=}; IFS=, read -r p1 p2 p3 envs <<< "$rest"
    [ $(left) -lt 30 ] && { echo "timeline $name skipped: $(left) s left"; continue; }
    echo "== timeline $name (P $p1 B $p2 U $p3 ${envs:-})"
    env CASCADE_CUDA_XV=18 $(echo "${envs:-}" | tr , ' ') CASCADE_CUDA_WIDE=17 CASCADE_CUDA_TRACE="$W/tl_$name.json" timeout 60 "$BB" --prefix $p1 --batch $p2 --suffix $p3 --json "$W/tl_$name.bench.json" 2>&1 | tail -1
    python3 bench/cuda/timeline.py "$W/tl_$name.json" --label "$name" --json "$W/tl_${name}_sum.json" --png "$W/tl_$name.png" 2>&1 | tail -8
  done
fi
if has ncudec; then
  # the headline's many-rows kernel under ncu per NCUDEC_VARIANTS entry
  # (name=ENV=VAL[,ENV=VAL]): DRAM and L2 bytes, L2 hit rate, tensor pipe
  NC=${NCUDEC_CASE:-"--batch 64 --prefix 32768 --suffix 512"}
  for var in ${NCUDEC_VARIANTS:-"k17=CASCADE_CUDA_WIDE=17 o3=CASCADE_CUDA_TAIL_ORDER=3 tw=CASCADE_CUDA_XV=35 diag=CASCADE_CUDA_WS_DIAG=1"}; do
    name=${var%%=*}; envs=${var#*=}
    [ $(left) -lt 40 ] && { echo "ncu decode $name skipped: $(left) s left"; continue; }
    echo "== ncu decode $name ($envs; $NC)"
    env CASCADE_CUDA_WIDE=17 $(echo "$envs" | tr , ' ') timeout $(( $(left) < 120 ? $(left) : 120 )) ncu --clock-control none -k regex:attn_wgmma --launch-skip 13 --launch-count 1 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,lts__t_sectors_op_read.sum,lts__t_sector_op_read_hit_rate.pct,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second "$BB" $NC --iters 1 > "$W/ncudec_$name.txt" 2>&1; echo "ncu rc=$?"
    grep -E "gpu__time|dram__|lts__|hmma|per_second" "$W/ncudec_$name.txt" | sed "s/^ */$name /" | head -12
  done
fi
if has cli && [ -n "$CAS" ]; then
  echo "== cascade attn-bench --backend cuda"
  CASCADE_CUDA_WIDE=${GRID_WIDE:-} timeout 90 "$CAS" attn-bench --backend cuda --batch 64 --prefix 32768 --suffix 512 --repeats 30 --warmup 5 --json > "$W/cli_headline.json" 2> "$W/cli.err"; echo "cli rc=$?"
  CASCADE_CUDA_WIDE=${GRID_WIDE:-} timeout 90 "$CAS" attn-bench --backend cuda --tree '32*8192(16*2048)+32*4096' --suffix 256 --repeats 30 --warmup 5 2>&1 | tee "$W/cli_tree.txt" | tail -6
  python3 -c "import json;d=json.load(open('$W/cli_headline.json'));print({k:d[k] for k in ['device','kernel','flat_ms','cascade_ms','cascade_all_ms','max_abs_err_cascade','peak_GBps','peak_GFLOPs']})" 2>&1 | tail -2
  tail -2 "$W/cli.err"
fi
if has ncupf; then
  # the 16k causal prefill's many-rows kernel under ncu, once per NCUPF_VARIANTS
  # entry (name=ENV=VAL[,ENV=VAL]): pipe utilization, warp states, issue
  for var in ${NCUPF_VARIANTS:-k17=CASCADE_CUDA_WIDE=17}; do
    name=${var%%=*}; envs=${var#*=}
    echo "== ncu prefill $name ($envs)"
    env $(echo "$envs" | tr , ' ') timeout 150 ncu --clock-control none -k regex:attn_wgmma --launch-skip 2 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__cycles_active.avg,sm__cycles_elapsed.avg.per_second,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio "$BB" --prefill 16384 --iters 3 > "$W/ncupf_$name.txt" 2>&1; echo "ncu rc=$?"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Executed Ipc A|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|pipe_|stalled|Warp Cycles Per Issued|hmma|xu|fma|alu" "$W/ncupf_$name.txt" | head -40
  done
fi
if has ncu; then
  echo "== ncu: the many-rows kernel of the headline cascade"
  # flat mode launches the wide kernel 13 times (run, 6 graph, 6 eager at --iters 1): skip them
  CASCADE_CUDA_WIDE=${NCU_WIDE:-3} timeout 150 ncu --clock-control none -k regex:attn_wgmma --launch-skip 13 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats "$BB" --batch 64 --prefix 32768 --suffix 512 --iters 1 > "$W/ncu.txt" 2>&1; echo "ncu rc=$?"
  grep -E "attn_|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Executed Ipc A|Tensor|L2 Hit|DRAM Throughput" "$W/ncu.txt" | head -60
fi
if has grid; then
  echo "== grid (CASCADE_CUDA_WIDE=${GRID_WIDE:-default}), $(left) s left"
  # kind 11 (tails on the producer's spare warps) is timed against kind 9 in the same process
  AB=${GRID_AB:-}; [ -z "$AB" ] && [ "${GRID_WIDE:-}" = 11 ] && AB=9
  CASCADE_BENCH_AB=$AB CASCADE_CUDA_WIDE=${GRID_WIDE:-} timeout $(( $(left) - ${GRID_RESERVE:-20} )) "$BB" --grid --json "$OUT/h200-attention.json" > "$OUT/grid.txt" 2> "$OUT/grid.err"; echo "grid rc=$? (ab kind ${AB:-none})"; head -1 "$OUT/grid.err"
  [ -f "$OUT/h200-attention.json" ] && python3 bench/cuda/plot_h200.py "$OUT/h200-attention.json" bench/cuda/anchor-flashinfer-grid.json "$OUT/h200-attention.png" "$OUT/table.md" 2>&1 | tail -1
  cat "$OUT/grid.txt"
fi
if has sanitize && [ $(left) -gt 60 ]; then
  export CASCADE_TEST_KINDS=${SANITIZE_KINDS:-${GRID_WIDE:-3}}
  echo "== memcheck / racecheck (quick, kinds $CASCADE_TEST_KINDS), $(left) s left"
  CASCADE_TEST_QUICK=1 timeout $(( $(left) / 2 )) compute-sanitizer --tool memcheck --error-exitcode 9 "$T" > "$W/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed" "$W/memcheck.log" | head -3
  CASCADE_TEST_QUICK=2 timeout $(( $(left) - 5 )) compute-sanitizer --tool racecheck --error-exitcode 9 "$T" > "$W/racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed" "$W/racecheck.log" | head -3
fi
rm -f "$W/sass.txt"  # megabytes: all.tgz would not come back
tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null
cp "$W/test_cuda.log" "$OUT/" 2>/dev/null
true
