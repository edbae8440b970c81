#!/usr/bin/env bash
# Several `cascade serve` replicas on one machine behind HAProxy
# (deploy/haproxy.cfg: routing by prompt prefix, consistent hashing with
# bounded load, health checks, retries of requests that never reached a
# replica).
#
#   deploy/replicas.sh start [options] [-- cascade serve options]
#   deploy/replicas.sh run   [options] [-- ...]  start, then stop everything at Ctrl-C
#   deploy/replicas.sh drain K     graceful removal of replica K: the balancer sends it
#                                  nothing new, it finishes its requests and exits
#   deploy/replicas.sh restart K   start replica K again (after a drain or a crash);
#                                  the balancer takes it back once /health answers
#   deploy/replicas.sh kill K      SIGKILL replica K (fault tests)
#   deploy/replicas.sh status      the balancer's view of the replicas
#   deploy/replicas.sh stop        drain every replica, then stop the balancer
#
# Options of start and run:
#   -n N              replicas (default 3)
#   --port P          the balancer's port (default 8000); replica K listens on P+1+K
#   --host ADDR       the balancer's address (default 127.0.0.1); the replicas listen on
#                     127.0.0.1
#   --balance B       prefix (default), roundrobin or leastconn: the last two replace the
#                     prefix routing, for comparisons
#   --device D        cpu (default) or cuda: replica K gets GPU K (CUDA_VISIBLE_DEVICES);
#                     with more replicas than GPUs they share, and each needs a
#                     --gpu-memory-fraction of its own after --
#   --cpus LIST       the cores to divide among the replicas (default: those this shell
#                     may use); replica K is pinned (taskset) to its share, or to all of
#                     them when there are fewer cores than replicas
#   --threads T       threads per replica (default: its share of the cores; 1 where
#                     the replicas share them)
#   --model PATH      GGUF model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --cascade BIN     the cascade command (default build/cascade)
#   --run-dir DIR     pid files, logs, the balancer's configuration and admin socket
#                     (default ${TMPDIR:-/tmp}/cascade-replicas-PORT)
#   --key-bytes N, --balance-factor PCT, --check-ms MS   see deploy/haproxy.cfg
# The other commands take --port or --run-dir to find the deployment.
#
# Each replica runs with --replica-name rK (every answer names it in its
# X-Cascade-Replica header) and --max-connections-per-ip 0 (all of its clients
# come from the balancer's address). Logs: RUN_DIR/rK.log and RUN_DIR/haproxy.log.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "replicas: $*" >&2; exit 1; }
say() { echo "replicas: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# ---- options ----------------------------------------------------------------
cmd=${1:-}
[ -n "$cmd" ] || { usage; exit 2; }
shift
N=3 PORT=8000 HOST=127.0.0.1 BALANCE=prefix DEVICE=cpu CPUS="" THREADS=""
MODEL=$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf CASCADE=$ROOT/build/cascade RUN_DIR=""
KEY_BYTES=512 FACTOR=200 CHECK_MS=1000
SERVE_ARGS=()
K=""
while [ $# -gt 0 ]; do
  case "$1" in
    -n) N=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    --balance) BALANCE=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --cpus) CPUS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --cascade) CASCADE=$2; shift 2 ;;
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --key-bytes) KEY_BYTES=$2; shift 2 ;;
    --balance-factor) FACTOR=$2; shift 2 ;;
    --check-ms) CHECK_MS=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; SERVE_ARGS=("$@"); break ;;
    [0-9]*) K=$1; shift ;;
    *) die "unknown option '$1' (deploy/replicas.sh --help)" ;;
  esac
done
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/cascade-replicas-$PORT}
STATE=$RUN_DIR/state

# ---- helpers ----------------------------------------------------------------

# the balancer's runtime API (HAProxy's admin socket); python3 speaks to the
# UNIX socket so that socat is not needed
lb() {
  python3 - "$RUN_DIR/haproxy.sock" "$*" <<'EOF'
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
out = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    out += b
sys.stdout.write(out.decode())
EOF
}

# the process of pid file $1 runs (a zombie does not: where no init reaps
# orphans, as in some containers, an exited replica can stay one)
alive() {
  local pid st
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null || return 1
  st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)
  [ "$st" != Z ]
}

# waits until URL answers 200, for up to $2 seconds (a large model loads
# slowly) and as long as the process of pid file $3 (if given) lives
wait_ok() {
  local url=$1 limit=$2 pidfile=${3:-} t=0
  while [ "$t" -lt $((limit * 10)) ]; do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" 2>/dev/null)" = 200 ] && return 0
    [ -z "$pidfile" ] || alive "$pidfile" || return 1
    sleep 0.1; t=$((t + 1))
  done
  return 1
}

# the cores this shell may use, as a list: "0-3,8" -> "0 1 2 3 8"
expand_cpus() {
  local out=() part a b
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then a=${part%-*}; b=${part#*-}; for ((c = a; c <= b; c++)); do out+=("$c"); done
    else out+=("$part"); fi
  done
  echo "${out[@]}"
}

# cores and threads of replica $1: an equal share of the cores when there are
# at least as many cores as replicas, else all of them, shared (then no
# replica is favoured; pinning two of three replicas to one core would make
# them half as fast as the third)
plan_cpus() {
  local k=$1 all n per
  read -ra all <<<"$(expand_cpus "$CPUS")"
  n=${#all[@]}
  if [ "$n" -ge "$N" ]; then
    per=$((n / N))
    REP_CPUS=$(IFS=,; echo "${all[*]:$((k * per)):$per}")
    REP_THREADS=${THREADS:-$per}
  else
    REP_CPUS=$(IFS=,; echo "${all[*]}")
    REP_THREADS=${THREADS:-1}
  fi
}

start_replica() {
  local k=$1 port env=()
  port=$((PORT + 1 + k))
  plan_cpus "$k"
  if [ "$DEVICE" = cuda ]; then
    env=(CUDA_VISIBLE_DEVICES="${GPUS[$((k % ${#GPUS[@]}))]}")
  fi
  echo "---- start $(date '+%F %T'): cores $REP_CPUS, $REP_THREADS threads ${env[*]}" >>"$RUN_DIR/r$k.log"
  # setsid: the replica outlives this script and a Ctrl-C in its terminal
  env "${env[@]}" setsid taskset -c "$REP_CPUS" "$CASCADE" serve -m "$MODEL" --device "$DEVICE" \
    --host 127.0.0.1 --port "$port" --replica-name "r$k" --max-connections-per-ip 0 \
    --threads "$REP_THREADS" "${SERVE_ARGS[@]}" >>"$RUN_DIR/r$k.log" 2>&1 </dev/null &
  echo $! >"$RUN_DIR/r$k.pid"
  say "r$k: 127.0.0.1:$port, cores $REP_CPUS, $REP_THREADS threads${env:+, ${env[*]}} (pid $!)"
}

wait_replica() {
  local k=$1
  wait_ok "http://127.0.0.1:$((PORT + 1 + k))/health" 600 "$RUN_DIR/r$k.pid" && return 0
  tail -n 5 "$RUN_DIR/r$k.log" >&2
  say "r$k did not become healthy (log: $RUN_DIR/r$k.log)"
  return 1
}

write_lb_config() {
  local balance
  case "$BALANCE" in
    prefix) balance="" ;;
    roundrobin|leastconn) balance="    balance $BALANCE" ;;
    *) die "--balance takes prefix, roundrobin or leastconn" ;;
  esac
  {
    local skip=0
    while IFS= read -r line; do
      if [[ $line == *"# -- servers"* ]]; then
        echo "$line"
        for ((k = 0; k < N; k++)); do echo "    server r$k 127.0.0.1:$((PORT + 1 + k))"; done
        skip=1; continue
      fi
      [[ $line == *"# -- end servers"* ]] && skip=0
      [ "$skip" = 1 ] && continue
      if [ -n "$balance" ] && [[ $line =~ ^\ +(balance|hash-type|hash-balance-factor)\  ]]; then
        [[ $line == *" balance "* ]] && echo "$balance"
        continue
      fi
      echo "$line"
    done <"$ROOT/deploy/haproxy.cfg"
  } >"$RUN_DIR/haproxy.cfg"
}

lb_env() {
  env CASCADE_LB_BIND="$HOST:$PORT" CASCADE_LB_RUN="$RUN_DIR" CASCADE_LB_KEY_BYTES="$KEY_BYTES" \
    CASCADE_LB_FACTOR="$FACTOR" CASCADE_LB_CHECK_MS="$CHECK_MS" "$@"
}

load_state() {
  [ -f "$STATE" ] || die "no deployment in $RUN_DIR (start one, or give --port / --run-dir)"
  # declare -g: the saved declarations must not become this function's locals
  # shellcheck disable=SC1090
  source <(sed 's/^declare /declare -g /' "$STATE")
}

need_k() {
  [ -n "$K" ] || die "$cmd needs a replica number"
  if [ "$K" -lt 0 ] || [ "$K" -ge "$N" ]; then die "no replica r$K (replicas r0 to r$((N - 1)))"; fi
}

# SIGTERM: the replica answers /health and new requests with 503 and finishes
# what it admitted (cascade serve --shutdown-timeout); waits for it to exit
stop_replica() {
  local k=$1 limit=$2 pid t=0
  alive "$RUN_DIR/r$k.pid" || return 0
  pid=$(cat "$RUN_DIR/r$k.pid")
  kill -TERM "$pid" 2>/dev/null || true
  while alive "$RUN_DIR/r$k.pid" && [ "$t" -lt $((limit * 10)) ]; do sleep 0.1; t=$((t + 1)); done
  if alive "$RUN_DIR/r$k.pid"; then
    say "r$k still running after ${limit}s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$RUN_DIR/r$k.pid"
}

# ---- commands ---------------------------------------------------------------

do_start() {
  command -v haproxy >/dev/null || die "haproxy is not installed (Debian: apt-get install haproxy)"
  [ -x "$CASCADE" ] || die "$CASCADE not found (make)"
  [ "$N" -ge 1 ] || die "-n needs at least 1"
  if [ -f "$STATE" ] && alive "$RUN_DIR/haproxy.pid"; then die "a deployment already runs in $RUN_DIR (stop it first)"; fi
  mkdir -p "$RUN_DIR"
  rm -f "$RUN_DIR"/*.log
  CPUS=${CPUS:-$(taskset -pc $$ | sed 's/.*: //')}
  GPUS=()
  if [ "$DEVICE" = cuda ]; then
    read -ra GPUS <<<"$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
    [ ${#GPUS[@]} -gt 0 ] || die "--device cuda: nvidia-smi lists no GPU"
    [ "$N" -le ${#GPUS[@]} ] || say "$N replicas on ${#GPUS[@]} GPUs: they share; give each a --gpu-memory-fraction"
  fi
  {
    declare -p N PORT HOST BALANCE DEVICE CPUS THREADS MODEL CASCADE KEY_BYTES FACTOR CHECK_MS GPUS
    declare -p SERVE_ARGS
  } >"$STATE"
  for ((k = 0; k < N; k++)); do start_replica "$k"; done
  for ((k = 0; k < N; k++)); do
    wait_replica "$k" || { do_stop >/dev/null 2>&1; die "start failed"; }
  done
  write_lb_config
  lb_env haproxy -c -q -f "$RUN_DIR/haproxy.cfg" || die "haproxy rejects $RUN_DIR/haproxy.cfg"
  lb_env setsid haproxy -W -db -f "$RUN_DIR/haproxy.cfg" -p "$RUN_DIR/haproxy.pid" >>"$RUN_DIR/haproxy.log" 2>&1 </dev/null &
  echo $! >"$RUN_DIR/haproxy.pid"
  if ! wait_ok "http://$HOST:$PORT/lb/health" 30 "$RUN_DIR/haproxy.pid"; then
    tail -n 5 "$RUN_DIR/haproxy.log" >&2
    do_stop >/dev/null 2>&1
    die "haproxy did not start"
  fi
  say "balancer ($BALANCE) on http://$HOST:$PORT, $N replicas; run directory $RUN_DIR"
}

do_stop() {
  load_state
  for ((k = 0; k < N; k++)); do
    if alive "$RUN_DIR/r$k.pid"; then kill -TERM "$(cat "$RUN_DIR/r$k.pid")" 2>/dev/null || true; fi
  done
  for ((k = 0; k < N; k++)); do stop_replica "$k" 60; done
  if alive "$RUN_DIR/haproxy.pid"; then
    local pid t=0
    pid=$(cat "$RUN_DIR/haproxy.pid")
    kill -USR1 "$pid" 2>/dev/null || true # soft stop: finish open connections
    while alive "$RUN_DIR/haproxy.pid" && [ "$t" -lt 100 ]; do sleep 0.1; t=$((t + 1)); done
    if alive "$RUN_DIR/haproxy.pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$RUN_DIR/haproxy.pid" "$STATE"
  say "stopped"
}

do_drain() {
  load_state; need_k
  # no new request goes to it (its keys move to the next replica on the ring)
  lb "set server replicas/r$K state drain" >/dev/null
  say "r$K: draining"
  stop_replica "$K" 120
  # no health checks while it is away; restart makes it ready again
  lb "set server replicas/r$K state maint" >/dev/null
  say "r$K: stopped, in maintenance"
}

do_restart() {
  load_state; need_k
  alive "$RUN_DIR/r$K.pid" && die "r$K is running"
  start_replica "$K"
  wait_replica "$K" || die "restart failed"
  lb "set server replicas/r$K state ready" >/dev/null
  say "r$K: back"
}

do_kill() {
  load_state; need_k
  alive "$RUN_DIR/r$K.pid" || die "r$K is not running"
  kill -KILL "$(cat "$RUN_DIR/r$K.pid")"
  rm -f "$RUN_DIR/r$K.pid"
  say "r$K: killed"
}

do_status() {
  load_state
  # the runtime API's server states (op: 0 down, 1 starting, 2 up, 3 stopping;
  # admin bits: 0x01 0x02 0x04 0x20 0x40 maintenance, 0x08 0x10 drain) and the
  # requests each replica has in flight and has served
  { lb "show servers state replicas"; echo "--"; lb "show stat"; } | awk -F'[ ,]' '
    $0 == "--" { csv = 1; next }
    !csv && NF > 20 && $1 !~ /^#/ { addr[$4] = $5 ":" $19; op[$4] = $6; adm[$4] = $7; order[++n] = $4 }
    csv && $1 == "replicas" && ($2 in op) { cur[$2] = $5; tot[$2] = $8 }
    END {
      for (i = 1; i <= n; i++) {
        s = order[i]; a = adm[s] + 0
        st = op[s] == 2 ? "up" : op[s] == 1 ? "starting" : op[s] == 3 ? "stopping" : "down"
        if (a % 8 || int(a / 32) % 4) st = st ", maintenance"; else if (int(a / 8) % 4) st = st ", draining"
        printf "%-4s %-16s %-18s in flight %s, served %s\n", s, addr[s], st, cur[s], tot[s]
      }
    }'
}

case "$cmd" in
  start) do_start ;;
  run)
    do_start
    trap 'do_stop; exit 0' INT TERM
    say "Ctrl-C stops every replica and the balancer"
    while :; do sleep 1; done ;;
  stop) do_stop ;;
  drain) do_drain ;;
  restart) do_restart ;;
  kill) do_kill ;;
  status) do_status ;;
  -h|--help|help) usage ;;
  *) die "unknown command '$cmd' (deploy/replicas.sh --help)" ;;
esac
