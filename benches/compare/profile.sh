#!/usr/bin/env bash
# Where does fencegate's proxy path spend its instructions, next to nginx?
#
#   bash benches/compare/profile.sh [--secs S] [--conns C] [--out DIR]
#
# Runs the part-1 load (fenced 1 KiB PUTs, keep-alive) against fencegate and
# against nginx (proxy_pass, upstream keepalive), each under
# `valgrind --tool=callgrind` with collection switched on only while the load
# runs, and prints instructions per request for both plus fencegate's top
# functions (inclusive and exclusive). Instruction counts do not depend on
# what else the machine is doing, so this is the measurement to trust on a
# shared 2-core box; requests/s under valgrind mean nothing.
# Needs valgrind (apt-get install valgrind). Loopback only; every process is
# stopped by PID on exit.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SECS=20
CONNS=32
OUTDIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --secs) SECS=$2; shift ;;
        --conns) CONNS=$2; shift ;;
        --out) OUTDIR=$2; shift ;;
        *) echo "profile.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
for c in nginx wrk; do command -v $c >/dev/null || { echo "profile.sh: needs $c (run run.sh once)" >&2; exit 2; }; done

WORK=$(mktemp -d /tmp/fencegate-profile.XXXXXX)
OUTDIR=${OUTDIR:-$WORK/out}
mkdir -p "$OUTDIR"
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    sleep 1
    for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    [ "${KEEP_WORK:-}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

if [ -n "${FENCEGATE_BIN:-}" ]; then FG=$FENCEGATE_BIN; else
    (cd "$ROOT" && cargo build --quiet --bin fencegate)
    FG=${CARGO_TARGET_DIR:-$ROOT/target}/debug/fencegate
fi
cp "$FG" "$WORK/fencegate"; FG=$WORK/fencegate

read -r P_BACKEND P_NGINX P_UNUSED P_FG P_FG_API <<<"$(python3 -c '
import socket; s=[socket.socket() for _ in range(5)]
[x.bind(("127.0.0.1",0)) for x in s]; print(" ".join(str(x.getsockname()[1]) for x in s))')"
fill() { sed -e "s#@WORK@#$WORK#g" -e "s#@PORT@#$2#g" -e "s#@STREAM_PORT@#$P_UNUSED#g" -e "s#@BACKEND@#$P_BACKEND#g" \
    -e "s#@SINK@#$P_BACKEND#g" "$HERE/conf/$1"; }
mkdir -p "$WORK"/nginx-{backend,proxy}-{body,proxy}
fill nginx-backend.conf "$P_BACKEND" >"$WORK/nginx-backend.conf"
# nginx under valgrind: one process (no master), so the worker is what is profiled.
fill nginx-proxy.conf "$P_NGINX" | sed 's/^master_process on;/master_process off;/' >"$WORK/nginx-proxy.conf"

wait_tcp() { local i; for i in $(seq 600); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; exit 1; }

taskset -c 0 nginx -p "$WORK" -e "$WORK/nb.err" -c "$WORK/nginx-backend.conf" >"$WORK/backend.log" 2>&1 &
PIDS+=($!)
taskset -c 1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUTDIR/callgrind.fencegate" \
    "$FG" serve --data-dir "$WORK/fg" --listen "127.0.0.1:$P_FG" --api-listen "127.0.0.1:$P_FG_API" \
    --upstream "http://127.0.0.1:$P_BACKEND" --log-level warn >"$WORK/fg.log" 2>&1 &
FG_PID=$!; PIDS+=($FG_PID)
taskset -c 1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUTDIR/callgrind.nginx" \
    nginx -p "$WORK" -e "$WORK/np.err" -c "$WORK/nginx-proxy.conf" >"$WORK/nginx.log" 2>&1 &
NG_PID=$!; PIDS+=($NG_PID)
wait_tcp "$P_BACKEND"; wait_tcp "$P_NGINX"; wait_tcp "$P_FG_API"; wait_tcp "$P_FG"
TOKEN=$(curl -sf "http://127.0.0.1:$P_FG_API/v1/locks/acquire" -d '{"key":"bench/obj","ttl_ms":3600000}' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["fencing_token"])')

run() { # name pid port
    local name=$1 pid=$2 port=$3 out
    FENCING_TOKEN=$TOKEN taskset -c 0 wrk -t1 -c"$CONNS" -d2s -s "$HERE/wrk/put.lua" "http://127.0.0.1:$port/bench/obj" >/dev/null # warm-up
    callgrind_control -i on "$pid" >/dev/null
    out=$(FENCING_TOKEN=$TOKEN taskset -c 0 wrk -t1 -c"$CONNS" -d"${SECS}s" --timeout 10s -s "$HERE/wrk/put.lua" "http://127.0.0.1:$port/bench/obj")
    callgrind_control -i off "$pid" >/dev/null
    callgrind_control -d "$pid" >/dev/null
    sed -n 's/^WRKJSON //p' <<<"$out" >"$OUTDIR/$name.wrk.json"
}
run fencegate "$FG_PID" "$P_FG"
run nginx "$NG_PID" "$P_NGINX"
sleep 1

python3 - "$OUTDIR" <<'EOF'
import glob, json, os, re, sys
out = sys.argv[1]
for name in ["fencegate", "nginx"]:
    w = json.load(open(f"{out}/{name}.wrk.json"))
    ir = 0
    for f in glob.glob(f"{out}/callgrind.{name}*"):
        for line in open(f, errors="replace"):
            m = re.match(r"^totals: (\d+)", line)
            if m:
                ir += int(m.group(1))
    print(f"{name}: {w['requests']} requests (non-2xx/errors: {w['err_status']}/{w['err_read'] + w['err_write'] + w['err_connect'] + w['err_timeout']}), "
          f"{ir:,} instructions while loaded = {ir / max(w['requests'], 1):,.0f} instructions per request")
EOF
# Stage 2, natively (no valgrind): where the CPU time goes, kernel included
# (perf with the cpu-clock software event, which works without hardware
# counters), and syscalls per request (strace -c).
kill -TERM "$FG_PID" "$NG_PID" 2>/dev/null || true
sleep 2
read -r P_FG2 P_FG2_API P_NG2 <<<"$(python3 -c '
import socket; s=[socket.socket() for _ in range(3)]
[x.bind(("127.0.0.1",0)) for x in s]; print(" ".join(str(x.getsockname()[1]) for x in s))')"
fill nginx-proxy.conf "$P_NG2" | sed 's/^master_process on;/master_process off;/' >"$WORK/nginx-proxy2.conf"
taskset -c 1 "$FG" serve --data-dir "$WORK/fg2" --listen "127.0.0.1:$P_FG2" --api-listen "127.0.0.1:$P_FG2_API" \
    --upstream "http://127.0.0.1:$P_BACKEND" --log-level warn >"$WORK/fg2.log" 2>&1 &
FG2=$!; PIDS+=($FG2)
taskset -c 1 nginx -p "$WORK" -e "$WORK/np2.err" -c "$WORK/nginx-proxy2.conf" >"$WORK/nginx2.log" 2>&1 &
NG2=$!; PIDS+=($NG2)
wait_tcp "$P_FG2_API"; wait_tcp "$P_FG2"; wait_tcp "$P_NG2"
TOKEN=$(curl -sf "http://127.0.0.1:$P_FG2_API/v1/locks/acquire" -d '{"key":"bench/obj","ttl_ms":3600000}' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["fencing_token"])')
native() { # name pid port
    local name=$1 pid=$2 port=$3 t0 t1 out n
    t0=$(sed 's/^.*) //' "/proc/$pid/stat" | awk '{print $12, $13}')
    out=$(FENCING_TOKEN=$TOKEN taskset -c 0 wrk -t1 -c"$CONNS" -d5s -s "$HERE/wrk/put.lua" "http://127.0.0.1:$port/bench/obj")
    t1=$(sed 's/^.*) //' "/proc/$pid/stat" | awk '{print $12, $13}')
    n=$(sed -n 's/^WRKJSON //p' <<<"$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["requests"])')
    awk -v a="$t0" -v b="$t1" -v n="$n" -v h="$(getconf CLK_TCK)" -v name="$name" 'BEGIN{split(a,x," "); split(b,y," ");
        printf "%s natively: %d requests in 5 s; CPU per request: user %.1f us, kernel %.1f us\n", name, n, (y[1]-x[1])/h*1e6/n, (y[2]-x[2])/h*1e6/n}'
    if command -v strace >/dev/null; then
        timeout -s INT 4 strace -c -f -p "$pid" -o "$OUTDIR/strace.$name" >/dev/null 2>&1 &
        sleep 0.5
        out=$(FENCING_TOKEN=$TOKEN taskset -c 0 wrk -t1 -c"$CONNS" -d3s -s "$HERE/wrk/put.lua" "http://127.0.0.1:$port/bench/obj")
        sleep 1.5
        n=$(sed -n 's/^WRKJSON //p' <<<"$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["requests"])')
        awk -v n="$n" -v name="$name" '$1 ~ /^[0-9.]+$/ && NF >= 5 && $NF != "total" {calls[$NF]=$4; tot+=$4}
            END{printf "%s syscalls per request (strace -c): %.2f  (", name, tot/n; for (k in calls) if (calls[k]/n >= 0.05) printf "%s %.2f ", k, calls[k]/n; print ")"}' "$OUTDIR/strace.$name"
    fi
    if command -v perf >/dev/null; then
        perf record -q -e cpu-clock -F 2000 -p "$pid" -o "$OUTDIR/perf.$name" -- sleep 4 >/dev/null 2>&1 &
        local pp=$!
        sleep 0.3
        FENCING_TOKEN=$TOKEN taskset -c 0 wrk -t1 -c"$CONNS" -d3s -s "$HERE/wrk/put.lua" "http://127.0.0.1:$port/bench/obj" >/dev/null
        wait "$pp" || true
        echo "--- $name: perf cpu-clock samples by object ---"
        perf report -i "$OUTDIR/perf.$name" --stdio --sort dso 2>/dev/null | grep -E '^ +[0-9.]+%' | head -5 || true
        echo "--- $name: perf cpu-clock top symbols ---"
        perf report -i "$OUTDIR/perf.$name" --stdio --sort sym 2>/dev/null | grep -E '^ +[0-9.]+%' | head -15 | cut -c1-150 || true
    fi
}
native fencegate "$FG2" "$P_FG2"
native nginx "$NG2" "$P_NG2"

f=$(ls -S "$OUTDIR"/callgrind.fencegate* | head -1)
echo "--- fencegate, inclusive (top 45) ---"
callgrind_annotate --inclusive=yes --threshold=100 "$f" 2>/dev/null | grep -E '^ *[0-9,]+ \(' | head -45 | cut -c1-230 || true
echo "--- fencegate, exclusive (top 40) ---"
callgrind_annotate --threshold=100 "$f" 2>/dev/null | grep -E '^ *[0-9,]+ \(' | head -40 | cut -c1-230 || true
echo "callgrind files in $OUTDIR"
