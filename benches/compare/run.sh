#!/usr/bin/env bash
# Side-by-side performance harness (issue 8): fencegate against nginx,
# HAProxy, Redis and etcd on this machine, on loopback only.
#
#   bash benches/compare/run.sh                 # full run (~16 min of measurements)
#   bash benches/compare/run.sh --smoke         # ~85 s of measurements, every part, short
#   bash benches/compare/run.sh --out FILE      # where the table goes
#   bash benches/compare/run.sh --cluster       # only part 6, cluster mode (~3 min of measurements)
#   bash benches/compare/run.sh --cluster --smoke   # only part 6, short (~30 s)
#
# Part 6 (cluster mode, issue 15; in --smoke runs too, short) starts a
# 3-member etcd cluster and, on it, 3 cluster-mode gateways, a 1-gateway
# cluster (its own prefix) and a single-node gateway, and compares lock
# cycles through the gateways with etcd's own lock (v3lock Lock/Unlock) and
# with the bare create-if-absent transaction + delete over gRPC, grant
# latency with 3 gateways and with 1, and fenced PUTs cluster vs single-node.
# etcd's own counters (gRPC calls by method, raft proposals) are read before
# and after every run: the etcd round trips per cycle.
#
# Installs what it needs (Debian: nginx, haproxy, redis-server, etcd-server,
# wrk), builds fencegate (`cargo build --bin fencegate`, the dev profile) and
# the load generator (benches/compare/loadgen, standalone), starts every
# server on free 127.0.0.1 ports, stops each by PID on exit. Every load is
# bounded in time. The load generator (and the backend) run on one CPU, the
# server under test on the other; every measurement is repeated, interleaved
# across targets (A B C D A B C D ...), and reported as medians and ratios.
#
# Environment: FENCEGATE_BIN (skip the build, use this binary; FENCEGATE_REV
# says what it was built from, for the table),
# BENCH_CPU_LOAD / BENCH_CPU_SUT (CPU numbers; default 0 and 1),
# BENCH_REPS (repetitions), KEEP_WORK=1 (keep the scratch directory).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
MODE=full
ONLY_CLUSTER=""
OUT=""
ARGS_GIVEN="$*"
ENV_GIVEN=""
for v in FENCEGATE_BIN FENCEGATE_REV BENCH_CPU_LOAD BENCH_CPU_SUT BENCH_REPS; do
    if [ -n "${!v:-}" ]; then ENV_GIVEN+="$v=\"${!v}\" "; fi
done
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) MODE=smoke ;;
        --cluster) ONLY_CLUSTER=1 ;;
        --out) OUT=${2:?--out needs a file}; shift ;;
        --out=*) OUT=${1#--out=} ;;
        -h | --help) sed -n '2,32p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$OUT" ]; then
    OUT=$HERE/RESULTS${ONLY_CLUSTER:+-cluster}.md
    [ "$MODE" = full ] || OUT=$HERE/RESULTS${ONLY_CLUSTER:+-cluster}-smoke.md
fi
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac

# ------------------------------------------------------------------ sizes
if [ "$MODE" = smoke ]; then
    REPS=${BENCH_REPS:-2}
    D_PROXY=1          # s per wrk run (part 1; wrk takes whole seconds)
    PROXY_CONNS="32 128"
    D_BIG=1            # s per 64 MiB run (part 2; at least one request)
    BIG_CONNS="1"
    D_LOCK=1           # s per lock run (part 3)
    LOCK_CLIENTS="1 8 64"
    RENEW_CLIENTS="64"
    SCALE_NS="1 10000"
    D_SCALE=1
    HOLD_LEASES=10000
    D_CLUSTER=1        # s per run (part 6)
    CLUSTER_REPS=${BENCH_REPS:-2}
    D_CLUSTER_PUT=1
else
    REPS=${BENCH_REPS:-5}
    D_PROXY=6
    PROXY_CONNS="32 128"
    D_BIG=6
    BIG_CONNS="1 4"
    D_LOCK=5
    LOCK_CLIENTS="1 8 64"
    RENEW_CLIENTS="1 64"
    SCALE_NS="1 10000 1000000"
    D_SCALE=6
    HOLD_LEASES=100000
    D_CLUSTER=5
    CLUSTER_REPS=${BENCH_REPS:-3}
    D_CLUSTER_PUT=5
fi
SCALE_CONNS=128

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
T_START=$(date +%s)

# ------------------------------------------------------------------ install
need_install=()
command -v nginx >/dev/null || need_install+=(nginx)
command -v haproxy >/dev/null || need_install+=(haproxy)
command -v redis-server >/dev/null || need_install+=(redis-server)
command -v etcd >/dev/null || need_install+=(etcd-server)
command -v wrk >/dev/null || need_install+=(wrk)
command -v taskset >/dev/null || need_install+=(util-linux)
command -v python3 >/dev/null || need_install+=(python3)
command -v curl >/dev/null || need_install+=(curl)
if [ ${#need_install[@]} -gt 0 ]; then
    log "installing ${need_install[*]}"
    # Keep the packages' own services (ports 80, 6379, 2379) from starting.
    made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_install[@]}" >/dev/null
    [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
fi

# ------------------------------------------------------------------ scratch, PIDs
WORK=$(mktemp -d /tmp/fencegate-compare.XXXXXX)
RES=$WORK/results.jsonl
: >"$RES"
declare -A PID=()   # name -> pid of every process we started
ORDER=()

children_of() { ps -o pid= --ppid "$1" 2>/dev/null | tr -d ' ' || true; }

stop_pid() { # pid: SIGTERM it (and its direct children), wait up to 15 s, then SIGKILL
    local pid=$1 kids i
    kill -0 "$pid" 2>/dev/null || return 0
    kids=$(children_of "$pid")
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 150); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    for k in $kids; do kill -0 "$k" 2>/dev/null && kill -KILL "$k" 2>/dev/null || true; done
    wait "$pid" 2>/dev/null || true
}

stop() { # name
    local name=$1
    [ -n "${PID[$name]:-}" ] || return 0
    stop_pid "${PID[$name]}"
    unset "PID[$name]"
}

cleanup() {
    local rc=$? i
    trap - EXIT INT TERM
    for ((i = ${#ORDER[@]} - 1; i >= 0; i--)); do stop "${ORDER[$i]}"; done
    if [ "${KEEP_WORK:-}" = 1 ]; then log "scratch kept in $WORK"; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ CPU placement
NCPU=$(nproc)
if [ "$NCPU" -ge 2 ]; then
    CPU_LOAD=${BENCH_CPU_LOAD:-0}
    CPU_SUT=${BENCH_CPU_SUT:-1}
    PLACEMENT="load generator and backend pinned to CPU $CPU_LOAD; server under test pinned to CPU $CPU_SUT (for 'direct' the backend is moved to CPU $CPU_SUT during the run)"
else
    CPU_LOAD=""
    CPU_SUT=""
    PLACEMENT="unpinned (only $NCPU CPU)"
fi
log "placement: $PLACEMENT"

# What the rest of the machine is doing (a 2-core box is often shared):
# busy % of each CPU over 2 s before anything of ours starts.
cpu_snap_early() { awk '/^cpu[0-9]+ /{t=0; for(i=2;i<=NF;i++) t+=$i; print $1, t, $5 + $6}' /proc/stat; }
cpu_snap_early >"$WORK/idle.before"; sleep 2; cpu_snap_early >"$WORK/idle.after"
BASELINE=$(awk 'NR==FNR { t[$1]=$2; i[$1]=$3; next } { dt=$2-t[$1]; di=$3-i[$1]; printf "%s%s %.0f%%", sep, $1, (dt > 0 ? 100 * (dt - di) / dt : 0); sep=", " }' "$WORK/idle.before" "$WORK/idle.after")
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
log "before the run, other processes kept the CPUs busy: $BASELINE (load average $LOAD_START)"
# What an fsync costs here: the durable lock figures (parts 3 and 5) move
# with it, fencegate's and Redis's alike, and not in the same proportion.
FSYNC=$(python3 - "$WORK" <<'PY'
import os, statistics, sys, time
path = os.path.join(sys.argv[1], "fsync-probe")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
block, took = b"x" * 4096, []
for _ in range(200):
    os.write(fd, block)
    t = time.perf_counter()
    os.fdatasync(fd)
    took.append((time.perf_counter() - t) * 1e6)
os.close(fd)
os.unlink(path)
took.sort()
print(f"{statistics.median(took):.0f} µs median, {took[179]:.0f} µs p90")
PY
)
log "an fdatasync of a 4 KiB append in the work directory: $FSYNC (200 in a row)"

pinned() { # cpu cmd...: run cmd pinned to cpu (or unpinned)
    local cpu=$1; shift
    if [ -n "$cpu" ]; then taskset -c "$cpu" "$@"; else "$@"; fi
}

move_cpu() { # cpu name: re-pin every thread of the process and its children
    local cpu=$1 pid=${PID[$2]} p
    [ -n "$cpu" ] || return 0
    for p in $pid $(children_of "$pid"); do taskset -a -cp "$cpu" "$p" >/dev/null; done
}

start() { # name cpu cmd...: start in the background, logs in $WORK/name.log
    local name=$1 cpu=$2; shift 2
    # A simple command with &: $! is the server's own PID (taskset execs it).
    if [ -n "$cpu" ]; then
        taskset -c "$cpu" "$@" >>"$WORK/$name.log" 2>&1 &
    else
        "$@" >>"$WORK/$name.log" 2>&1 &
    fi
    PID[$name]=$!
    ORDER+=("$name")
}

free_ports() { # n: print n distinct free loopback ports
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

wait_tcp() { # port [secs]
    local port=$1 secs=${2:-30} i
    for i in $(seq $((secs * 20))); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        sleep 0.05
    done
    die "nothing listens on 127.0.0.1:$port after ${secs}s"
}

wait_http() { # url [secs]: a deadline on the clock (each try may take up to 1 s)
    local url=$1 secs=${2:-30} deadline
    deadline=$(($(date +%s) + secs))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        curl -sf -o /dev/null --max-time 1 "$url" && return 0
        sleep 0.01
    done
    die "$url not ready after ${secs}s"
}

rss_kib() { awk '/^VmRSS:/{print $2}' "/proc/$1/status"; }
hwm_kib() { awk '/^VmHWM:/{print $2}' "/proc/$1/status"; }
reset_hwm() { echo 5 >"/proc/$1/clear_refs"; }
tree_rss_kib() { local s=0 p; for p in "$1" $(children_of "$1"); do s=$((s + $(rss_kib "$p"))); done; echo "$s"; }

proc_ticks() { # pids...: "utime stime" of these processes (all threads), in clock ticks
    local u=0 s=0 p v
    for p in "$@"; do
        v=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12, $13}') || v="0 0"
        set -- $v
        u=$((u + ${1:-0})); s=$((s + ${2:-0}))
    done
    echo "$u $s"
}
cpu_snap() { awk '/^cpu[0-9]+ /{t=0; for(i=2;i<=NF;i++) t+=$i; print $1, t, $5 + $6}' /proc/stat; }
busy_pct() { # before after cpuN
    awk -v c="cpu$3" 'NR==FNR { if ($1==c) { t0=$2; i0=$3 } next } $1==c { dt=$2-t0; di=$3-i0; printf "%.0f", (dt > 0 ? 100 * (dt - di) / dt : 0) }' "$1" "$2"
}
CLK_TCK=$(getconf CLK_TCK)

# measure "SUT-name-or-empty" cmd...: runs cmd (its stdout is the result),
# and prints {"m": <last JSON-ish line>, "cpu": {...}} on stdout.
measure() {
    local sut=$1; shift
    local pids="" p0 p1 out
    if [ -n "$sut" ]; then pids="${PID[$sut]} $(children_of "${PID[$sut]}")"; fi
    cpu_snap >"$WORK/cpu.before"
    # shellcheck disable=SC2086
    p0=$(proc_ticks $pids)
    out=$("$@") || { log "load generator failed: $*"; out='{"failed":true}'; }
    # shellcheck disable=SC2086
    p1=$(proc_ticks $pids)
    cpu_snap >"$WORK/cpu.after"
    local lb sb
    lb=$( [ -n "$CPU_LOAD" ] && busy_pct "$WORK/cpu.before" "$WORK/cpu.after" "$CPU_LOAD" || echo null)
    sb=$( [ -n "$CPU_SUT" ] && busy_pct "$WORK/cpu.before" "$WORK/cpu.after" "$CPU_SUT" || echo null)
    out=$(printf '%s\n' "$out" | sed -n 's/^WRKJSON //p; /^{/p' | tail -1)
    [ -n "$out" ] || out='{"failed":true}'
    printf '{"m":%s,"cpu":{%s,"load_busy_pct":%s,"sut_busy_pct":%s}}' "$out" \
        "$(awk -v a="$p0" -v b="$p1" -v h="$CLK_TCK" 'BEGIN{split(a, x, " "); split(b, y, " "); u=(y[1]-x[1])/h; s=(y[2]-x[2])/h;
            printf "\"sut_cpu_s\":%.3f,\"sut_user_s\":%.3f,\"sut_sys_s\":%.3f", u+s, u, s}')" "${lb:-null}" "${sb:-null}"
}

record() { # json-fields measured-json
    printf '{%s,%s\n' "$1" "${2#\{}" >>"$RES"
}

# ------------------------------------------------------------------ build
if [ -n "${FENCEGATE_BIN:-}" ]; then
    FG_SRC=$FENCEGATE_BIN
else
    log "building fencegate (cargo build --bin fencegate, dev profile)"
    (cd "$ROOT" && cargo build --quiet --bin fencegate)
    FG_SRC=${CARGO_TARGET_DIR:-$ROOT/target}/debug/fencegate
fi
mkdir -p "$WORK/bin"
cp "$FG_SRC" "$WORK/bin/fencegate"   # a snapshot: a concurrent rebuild cannot swap it mid-run
FG=$WORK/bin/fencegate
log "building the load generator (benches/compare/loadgen, release)"
LOADGEN=$(bash "$HERE/build-loadgen.sh")
T_BUILT=$(date +%s)

if [ -n "${FENCEGATE_BIN:-}" ]; then
    FG_DESC="fencegate binary $FENCEGATE_BIN${FENCEGATE_REV:+ (built from $FENCEGATE_REV)}"
else
    FG_DESC="fencegate $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown) (+$(cd "$ROOT" &&
        git status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null | wc -l) uncommitted paths in src/, Cargo.*)"
fi

loadgen() { pinned "$CPU_LOAD" "$LOADGEN" "$@"; }
wrk_put() { # conns secs url [env...]
    local c=$1 d=$2 url=$3; shift 3
    env "$@" taskset -c "${CPU_LOAD:-0-$((NCPU - 1))}" wrk -t1 -c"$c" -d"${d}s" --timeout 5s -s "$HERE/wrk/put.lua" "$url"
}
acquire_token() { # api-port key -> token
    curl -sf "http://127.0.0.1:$1/v1/locks/acquire" -d "{\"key\":\"$2\",\"ttl_ms\":3600000}" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["fencing_token"])'
}
fill() { sed -e "s#@WORK@#$WORK#g" -e "s#@PORT@#${2:-}#g" -e "s#@STREAM_PORT@#${3:-}#g" -e "s#@BACKEND@#$P_BACKEND#g" \
    -e "s#@SINK@#$P_SINK#g" "$HERE/conf/$1"; }

# ------------------------------------------------------------------ servers for parts 1, 2, 4
read -r P_BACKEND P_SINK P_NGINX P_NGINX_STREAM P_HAPROXY P_FG P_FG_API P_FGB P_FGB_API <<<"$(free_ports 9)"
fill nginx-backend.conf "$P_BACKEND" >"$WORK/nginx-backend.conf"
fill nginx-proxy.conf "$P_NGINX" "$P_NGINX_STREAM" >"$WORK/nginx-proxy.conf"
fill haproxy.cfg "$P_HAPROXY" >"$WORK/haproxy.cfg"
mkdir -p "$WORK"/nginx-{backend,proxy}-{body,proxy}
LEASES_RC=0
if [ -z "$ONLY_CLUSTER" ]; then   # parts 1 to 5

start backend "$CPU_LOAD" nginx -p "$WORK" -e "$WORK/nginx-backend.err" -c "$WORK/nginx-backend.conf"
start nginx "$CPU_SUT" nginx -p "$WORK" -e "$WORK/nginx-proxy.err" -c "$WORK/nginx-proxy.conf"
start haproxy "$CPU_SUT" haproxy -db -f "$WORK/haproxy.cfg"
start fencegate "$CPU_SUT" "$FG" serve --data-dir "$WORK/fg-main" --listen "127.0.0.1:$P_FG" \
    --api-listen "127.0.0.1:$P_FG_API" --upstream "http://127.0.0.1:$P_BACKEND" --log-level warn
# Part 2's backend reads each body to its end before it answers (nginx
# `return 200` answers a 64 MiB PUT at once and discards the rest, which
# makes a proxy drop the upstream connection mid-body).
start sink "$CPU_LOAD" "$LOADGEN" sink "$P_SINK"
start fencegate_big "$CPU_SUT" "$FG" serve --data-dir "$WORK/fg-big" --listen "127.0.0.1:$P_FGB" \
    --api-listen "127.0.0.1:$P_FGB_API" --upstream "http://127.0.0.1:$P_SINK" --log-level warn
for p in $P_BACKEND $P_SINK $P_NGINX $P_NGINX_STREAM $P_HAPROXY $P_FG $P_FGB; do wait_tcp "$p"; done
wait_http "http://127.0.0.1:$P_FG_API/readyz"
wait_http "http://127.0.0.1:$P_FGB_API/readyz"
TOKEN=$(acquire_token "$P_FG_API" bench/obj)
BIG_TOKEN=$(acquire_token "$P_FGB_API" big/obj)
log "servers up: backend :$P_BACKEND sink :$P_SINK nginx :$P_NGINX/:$P_NGINX_STREAM haproxy :$P_HAPROXY fencegate :$P_FG (api :$P_FG_API) fencegate-big :$P_FGB; token $TOKEN"

target_url() { # target path
    case "$1" in
        direct) echo "http://127.0.0.1:$P_BACKEND$2" ;;
        direct-sink) echo "http://127.0.0.1:$P_SINK$2" ;;
        fencegate-big) echo "http://127.0.0.1:$P_FGB$2" ;;
        nginx) echo "http://127.0.0.1:$P_NGINX$2" ;;
        nginx-stream) echo "http://127.0.0.1:$P_NGINX_STREAM$2" ;;
        haproxy) echo "http://127.0.0.1:$P_HAPROXY$2" ;;
        fencegate) echo "http://127.0.0.1:$P_FG$2" ;;
    esac
}
sut_of() { case "$1" in direct) echo backend ;; direct-sink) echo sink ;; nginx-stream) echo nginx ;; fencegate-big) echo fencegate_big ;; *) echo "$1" ;; esac; }

# ------------------------------------------------------------------ part 1: proxy path
log "part 1: fenced 1 KiB PUTs, ${REPS}x interleaved, ${D_PROXY}s each, conns: $PROXY_CONNS"
for t in direct nginx haproxy fencegate; do   # warm-up, not recorded
    if [ "$t" = direct ]; then move_cpu "$CPU_SUT" backend; fi
    wrk_put 32 1 "$(target_url "$t" /bench/obj)" FENCING_TOKEN="$TOKEN" >/dev/null
    if [ "$t" = direct ]; then move_cpu "$CPU_LOAD" backend; fi
done
for rep in $(seq "$REPS"); do
    for c in $PROXY_CONNS; do
        for t in direct nginx haproxy fencegate; do
            if [ "$t" = direct ]; then move_cpu "$CPU_SUT" backend; fi
            r=$(measure "$(sut_of "$t")" wrk_put "$c" "$D_PROXY" "$(target_url "$t" /bench/obj)" FENCING_TOKEN="$TOKEN")
            if [ "$t" = direct ]; then move_cpu "$CPU_LOAD" backend; fi
            record "\"part\":\"proxy\",\"target\":\"$t\",\"conns\":$c,\"rep\":$rep" "$r"
            log "  rep $rep c=$c $t: $(printf '%s' "$r" | cut -c1-150)"
        done
    done
done

# ------------------------------------------------------------------ part 2: 64 MiB PUTs
log "part 2: 64 MiB streamed PUTs, ${REPS}x interleaved, ${D_BIG}s each, conns: $BIG_CONNS"
BIG_REPS=$REPS; [ "$MODE" = full ] && BIG_REPS=3
for rep in $(seq "$BIG_REPS"); do
    for c in $BIG_CONNS; do
        for t in direct-sink nginx-stream fencegate-big; do
            s=$(sut_of "$t")
            if [ "$t" = direct-sink ]; then move_cpu "$CPU_SUT" sink; fi
            # peak RSS of the proxy process (nginx: its worker) during this run only
            rss_pid=${PID[$s]}
            if [ "$s" = nginx ]; then rss_pid=$(children_of "${PID[$s]}" | head -1); fi
            reset_hwm "$rss_pid"
            rss0=$(rss_kib "$rss_pid")
            tok=""
            if [ "$t" = fencegate-big ]; then tok=$BIG_TOKEN; fi
            r=$(measure "$s" loadgen bigput "$(target_url "$t" /big/obj)" --size 64MiB --conns "$c" --secs "$D_BIG" ${tok:+--token "$tok"})
            hwm=$(hwm_kib "$rss_pid")
            if [ "$t" = direct-sink ]; then move_cpu "$CPU_LOAD" sink; fi
            record "\"part\":\"big\",\"target\":\"$t\",\"conns\":$c,\"rep\":$rep,\"rss_before_kib\":$rss0,\"peak_rss_kib\":$hwm" "$r"
            log "  rep $rep c=$c $t: peak RSS ${hwm} KiB $(printf '%s' "$r" | cut -c1-150)"
        done
    done
done
stop haproxy
stop nginx
stop fencegate
stop fencegate_big
stop sink

# ------------------------------------------------------------------ part 3: lock service
read -r P_REDIS_A P_REDIS_N P_ETCD P_ETCD_PEER P_FGL P_FGL_API <<<"$(free_ports 6)"
mkdir -p "$WORK/redis-always" "$WORK/redis-none"
start redis_always "$CPU_SUT" redis-server --bind 127.0.0.1 --port "$P_REDIS_A" --dir "$WORK/redis-always" \
    --save "" --appendonly yes --appendfsync always --daemonize no --protected-mode no --logfile ""
start redis_none "$CPU_SUT" redis-server --bind 127.0.0.1 --port "$P_REDIS_N" --dir "$WORK/redis-none" \
    --save "" --appendonly no --daemonize no --protected-mode no --logfile ""
start etcd "$CPU_SUT" etcd --name bench --data-dir "$WORK/etcd" \
    --listen-client-urls "http://127.0.0.1:$P_ETCD" --advertise-client-urls "http://127.0.0.1:$P_ETCD" \
    --listen-peer-urls "http://127.0.0.1:$P_ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$P_ETCD_PEER" \
    --initial-cluster "bench=http://127.0.0.1:$P_ETCD_PEER" --logger zap --log-level warn
start fencegate_locks "$CPU_SUT" "$FG" serve --data-dir "$WORK/fg-locks" --listen "127.0.0.1:$P_FGL" \
    --api-listen "127.0.0.1:$P_FGL_API" --upstream "http://127.0.0.1:$P_BACKEND" --log-level warn
for p in $P_REDIS_A $P_REDIS_N $P_ETCD $P_FGL_API; do wait_tcp "$p"; done
wait_http "http://127.0.0.1:$P_ETCD/health"
wait_http "http://127.0.0.1:$P_FGL_API/readyz"

lock_addr() {
    case "$1" in
        fencegate) echo "fencegate 127.0.0.1:$P_FGL_API" ;;
        redis-always) echo "redis 127.0.0.1:$P_REDIS_A" ;;
        redis-none) echo "redis 127.0.0.1:$P_REDIS_N" ;;
        etcd) echo "etcd 127.0.0.1:$P_ETCD" ;;
    esac
}
lock_sut() { case "$1" in fencegate) echo fencegate_locks ;; redis-always) echo redis_always ;; redis-none) echo redis_none ;; *) echo "$1" ;; esac; }
LOCK_SYSTEMS="fencegate redis-always redis-none etcd"
log "part 3: lock service, ${REPS}x interleaved, ${D_LOCK}s each; cycles with $LOCK_CLIENTS clients, renewals with $RENEW_CLIENTS"
LOCK_REPS=$REPS; [ "$MODE" = full ] && LOCK_REPS=3
for s in $LOCK_SYSTEMS; do   # warm-up
    # shellcheck disable=SC2046
    loadgen lock $(lock_addr "$s") --op cycle --clients 8 --secs 0.5 >/dev/null
done
for rep in $(seq "$LOCK_REPS"); do
    for c in $LOCK_CLIENTS; do
        for s in $LOCK_SYSTEMS; do
            # shellcheck disable=SC2046
            r=$(measure "$(lock_sut "$s")" loadgen lock $(lock_addr "$s") --op cycle --clients "$c" --secs "$D_LOCK" --prefix "c$rep/")
            record "\"part\":\"lock\",\"op\":\"cycle\",\"target\":\"$s\",\"clients\":$c,\"rep\":$rep" "$r"
            log "  rep $rep cycle c=$c $s: $(printf '%s' "$r" | cut -c1-150)"
        done
    done
    for c in $RENEW_CLIENTS; do
        for s in $LOCK_SYSTEMS; do
            # shellcheck disable=SC2046
            r=$(measure "$(lock_sut "$s")" loadgen lock $(lock_addr "$s") --op renew --clients "$c" --secs "$D_LOCK" --prefix "r$rep/")
            record "\"part\":\"lock\",\"op\":\"renew\",\"target\":\"$s\",\"clients\":$c,\"rep\":$rep" "$r"
            log "  rep $rep renew c=$c $s: $(printf '%s' "$r" | cut -c1-150)"
        done
    done
done
stop fencegate_locks
stop etcd
stop redis_none
stop redis_always

# ------------------------------------------------------------------ part 4: scale
log "part 4: fence-table scale, N = $SCALE_NS"
declare -A SP SA STOK
SCALE_LOG="warn,fencegate::app=info"   # keeps the "fence table rebuilt ... elapsed_ms" line
for n in $SCALE_NS; do
    read -r SP[$n] SA[$n] <<<"$(free_ports 2)"
    fill fencegate-scale.toml >"$WORK/fg-scale.toml"
    start "scale$n" "$CPU_SUT" env RUST_LOG="$SCALE_LOG" "$FG" serve --config "$WORK/fg-scale.toml" \
        --data-dir "$WORK/fg-scale-$n" --listen "127.0.0.1:${SP[$n]}" --api-listen "127.0.0.1:${SA[$n]}"
    wait_http "http://127.0.0.1:${SA[$n]}/readyz"
    t0=$(date +%s.%N)
    f=$(loadgen fill "http://127.0.0.1:${SP[$n]}/ext/r/" --keys "$n" --conns 256)
    log "  prefilled $n fences in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s: $f"
    record "\"part\":\"prefill\",\"n\":$n" "{\"m\":$f}"
    STOK[$n]=$(acquire_token "${SA[$n]}" bench/obj)
done
NMAX=${SCALE_NS##* }

restart() { # n: SIGTERM, start again on the same data dir; sets RESTART_MS (until /readyz answers)
    local n=$1 t0 t1
    stop "scale$n"
    t0=$(date +%s%N)
    start "scale$n" "$CPU_SUT" env RUST_LOG="$SCALE_LOG" "$FG" serve --config "$WORK/fg-scale.toml" \
        --data-dir "$WORK/fg-scale-$n" --listen "127.0.0.1:${SP[$n]}" --api-listen "127.0.0.1:${SA[$n]}"
    wait_http "http://127.0.0.1:${SA[$n]}/readyz" 60
    t1=$(date +%s%N)
    RESTART_MS=$(((t1 - t0) / 1000000))
}
for rep in $(seq 3); do
    for n in $SCALE_NS; do
        restart "$n"
        ms=$RESTART_MS
        sleep 0.5
        rss=$(rss_kib "${PID[scale$n]}")
        rebuild=$(sed -e 's/\x1b\[[0-9;]*m//g' "$WORK/scale$n.log" | sed -n 's/.*fence table rebuilt.*elapsed_ms=\([0-9]*\).*/\1/p' | tail -1)
        record "\"part\":\"restart\",\"n\":$n,\"rep\":$rep" "{\"m\":{\"restart_ms\":$ms,\"rss_kib\":$rss,\"rebuild_ms\":${rebuild:-null}}}"
        log "  restart rep $rep N=$n: ${ms} ms to ready, table rebuild ${rebuild:-?} ms, RSS ${rss} KiB"
    done
done

for rep in $(seq "$REPS"); do
    for n in $SCALE_NS; do
        r=$(measure "scale$n" wrk_put "$SCALE_CONNS" "$D_SCALE" "http://127.0.0.1:${SP[$n]}/bench/obj" FENCING_TOKEN="${STOK[$n]}")
        record "\"part\":\"scale\",\"load\":\"hot\",\"n\":$n,\"rep\":$rep" "$r"
        log "  rep $rep N=$n hot: $(printf '%s' "$r" | cut -c1-120)"
        r=$(measure "scale$n" wrk_put "$SCALE_CONNS" "$D_SCALE" "http://127.0.0.1:${SP[$n]}/" FENCING_TOKEN=1 RANDOM_KEYS="$n" KEY_PREFIX=/ext/r/)
        record "\"part\":\"scale\",\"load\":\"random\",\"n\":$n,\"rep\":$rep" "$r"
        log "  rep $rep N=$n random: $(printf '%s' "$r" | cut -c1-120)"
    done
done

# Memory per live lease: hold L leases on keys that already have a fence.
hold_n=$HOLD_LEASES; [ "$hold_n" -le "$NMAX" ] || hold_n=$NMAX
rss0=$(rss_kib "${PID[scale$NMAX]}")
h=$(loadgen hold "127.0.0.1:${SA[$NMAX]}" --keys "$hold_n" --clients 64 --prefix ext/r/)
sleep 0.5
rss1=$(rss_kib "${PID[scale$NMAX]}")
record "\"part\":\"leases\",\"n\":$NMAX" "{\"m\":{\"leases\":$hold_n,\"rss_before_kib\":$rss0,\"rss_after_kib\":$rss1,\"hold\":$h}}"
log "  $hold_n live leases: RSS $rss0 -> $rss1 KiB ($h)"
for n in $SCALE_NS; do stop "scale$n"; done
stop backend

# ------------------------------------------------------------------ part 5 (smoke only): held leases
# Issue 18's fill and restart with N = 5,000 (the full N = 500,000 is run on
# its own: python3 benches/compare/leases500k.py). Its own servers, its own
# PIDs; only its checks count here, its figures are not put in the table.
if [ "$MODE" = smoke ]; then
    log "part 5: held leases, fill and restart (leases500k.py --smoke)"
    FENCEGATE_BIN="$FG" LOADGEN_BIN="$LOADGEN" python3 "$HERE/leases500k.py" --smoke --budget-s 150 --out "$WORK/leases.json" \
        >/dev/null 2>"$WORK/leases.log" || LEASES_RC=$?
    sed 's/^/  /' "$WORK/leases.log" >&2
fi
fi   # parts 1 to 5

# ------------------------------------------------------------------ part 6: cluster mode
source "$HERE/cluster-part.sh"
T_END=$(date +%s)

# ------------------------------------------------------------------ report
cat >"$WORK/meta.json" <<EOF
{"mode":"$MODE","command":"${ENV_GIVEN//\"/\\\"}bash benches/compare/run.sh${ARGS_GIVEN:+ $ARGS_GIVEN}","date":"$(date -u '+%Y-%m-%d %H:%M UTC')",
 "machine":"$(nproc) CPUs ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, $(. /etc/os-release; echo "$PRETTY_NAME"), kernel $(uname -r)",
 "placement":"$PLACEMENT",
 "versions":"$FG_DESC, dev profile; $(nginx -v 2>&1 | sed 's/.*: //'); HAProxy $(haproxy -v | head -1 | awk '{print $3}'); Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'); etcd $(etcd --version | head -1 | awk '{print $3}'); $(wrk -v 2>&1 | head -1 | awk '{print $1, $2}')",
 "only_cluster":${ONLY_CLUSTER:-0},"d_cluster":$D_CLUSTER,"cluster_reps":$CLUSTER_REPS,"d_cluster_put":$D_CLUSTER_PUT,
 "reps":$REPS,"d_proxy":$D_PROXY,"d_big":$D_BIG,"d_lock":$D_LOCK,"d_scale":$D_SCALE,"scale_conns":$SCALE_CONNS,
 "build_s":$((T_BUILT - T_START)),"run_s":$((T_END - T_BUILT)),
 "baseline":"$BASELINE","fsync":"$FSYNC","load_start":"$LOAD_START","load_end":"$(cut -d' ' -f1-3 /proc/loadavg)"}
EOF
report_rc=0
python3 "$HERE/report.py" "$RES" "$WORK/meta.json" >"$OUT" || report_rc=$?
cp "$RES" "${OUT%.md}.jsonl"
cat "$OUT"
log "table written to $OUT (raw measurements: ${OUT%.md}.jsonl); build $((T_BUILT - T_START)) s, measurements $((T_END - T_BUILT)) s"
if [ "$LEASES_RC" -ne 0 ]; then
    log "part 5 (held leases, leases500k.py --smoke) failed: see its lines above"
    [ "$report_rc" -ne 0 ] || report_rc=$LEASES_RC
fi
if [ "$report_rc" -ne 0 ]; then
    log "some measurements failed or saw errors (see 'Problems' in $OUT)"
    exit "$report_rc"
fi
