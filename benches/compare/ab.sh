#!/usr/bin/env bash
# Interleaved A/B of two fencegate binaries on the proxy path: does a change
# move the side-by-side figures? Both gateways run at once on the same CPU
# (pinned), in front of the same nginx backend; wrk loads one at a time in
# the order A B B A per repetition (drift on a shared machine cancels out),
# fenced 1 KiB PUTs as in part 1 of run.sh, with the access log on (the
# default) or off.
#
#   bash benches/compare/ab.sh BIN_A BIN_B [--reps N] [--secs S] [--conns "32 128"] [--log on|off] [--out FILE]
#
# Prints one line per run and a table of medians: req/s and p99 of A and B,
# and B/A. Stops everything it started by PID. Needs nginx and wrk
# (run.sh installs them).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
A=${1:?usage: ab.sh BIN_A BIN_B [--reps N] [--secs S] [--conns LIST] [--log on|off] [--out FILE]}
B=${2:?usage: ab.sh BIN_A BIN_B ...}
shift 2
REPS=5 SECS=5 CONNS="32 128" LOGS=on OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --reps) REPS=${2:?}; shift ;;
        --secs) SECS=${2:?}; shift ;;
        --conns) CONNS=${2:?}; shift ;;
        --log) LOGS=${2:?}; shift ;;
        --out) OUT=${2:?}; shift ;;
        *) echo "ab.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ "$REPS" -ge 1 ] && [ "$REPS" -le 50 ] && [ "$SECS" -ge 1 ] && [ "$SECS" -le 60 ] ||
    { echo "ab.sh: --reps 1..50, --secs 1..60" >&2; exit 2; }
for t in nginx wrk taskset curl python3; do
    command -v "$t" >/dev/null || { echo "ab.sh: $t is missing (bash benches/compare/run.sh installs it)" >&2; exit 2; }
done

WORK=$(mktemp -d /tmp/fencegate-ab.XXXXXX)
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

NCPU=$(nproc)
CPU_LOAD=0 CPU_SUT=$((NCPU > 1 ? 1 : 0))
read -r P_BACKEND P_A P_A_API P_B P_B_API <<<"$(python3 -c '
import socket
s = [socket.socket() for _ in range(5)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')"
sed -e "s#@WORK@#$WORK#g" -e "s#@PORT@#$P_BACKEND#g" "$HERE/conf/nginx-backend.conf" >"$WORK/backend.conf"
mkdir -p "$WORK"/nginx-backend-{body,proxy} "$WORK/bin"
cp "$A" "$WORK/bin/a"   # snapshots: a rebuild cannot swap a binary mid-run
cp "$B" "$WORK/bin/b"

taskset -c "$CPU_LOAD" nginx -p "$WORK" -e "$WORK/backend.err" -c "$WORK/backend.conf" >"$WORK/backend.log" 2>&1 &
PIDS+=($!)
gateway() { # name port api-port
    # The access log is the info level, on stderr (to a file, as a
    # service manager would).
    local level=warn
    if [ "$LOGS" = on ]; then level=info; fi
    taskset -c "$CPU_SUT" "$WORK/bin/$1" serve --data-dir "$WORK/$1-data" --listen "127.0.0.1:$2" \
        --api-listen "127.0.0.1:$3" --upstream "http://127.0.0.1:$P_BACKEND" --log-level "$level" \
        >"$WORK/$1.log" 2>&1 &
    PIDS+=($!)
}
gateway a "$P_A" "$P_A_API"
gateway b "$P_B" "$P_B_API"
ready() { # url
    local i
    for i in $(seq 300); do curl -sf -o /dev/null --max-time 1 "$1" && return 0; sleep 0.1; done
    echo "ab.sh: $1 not ready (logs: $WORK)" >&2
    exit 1
}
ready "http://127.0.0.1:$P_A_API/readyz"
ready "http://127.0.0.1:$P_B_API/readyz"
token() { curl -sf "http://127.0.0.1:$1/v1/locks/acquire" -d '{"key":"bench/obj","ttl_ms":3600000}' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["fencing_token"])'; }
TOK_A=$(token "$P_A_API")
TOK_B=$(token "$P_B_API")

run() { # which conns secs
    local port=$P_A tok=$TOK_A
    if [ "$1" = b ]; then port=$P_B tok=$TOK_B; fi
    FENCING_TOKEN="$tok" taskset -c "$CPU_LOAD" wrk -t1 -c"$2" -d"$3s" --timeout 5s -s "$HERE/wrk/put.lua" \
        "http://127.0.0.1:$port/bench/obj" | sed -n 's/^WRKJSON //p'
}
RES=$WORK/ab.jsonl
for c in $CONNS; do run a "$c" 1 >/dev/null; run b "$c" 1 >/dev/null; done   # warm-up
for rep in $(seq "$REPS"); do
    for c in $CONNS; do
        for which in a b b a; do
            m=$(run "$which" "$c" "$SECS")
            printf '{"which":"%s","conns":%s,"rep":%s,"m":%s}\n' "$which" "$c" "$rep" "${m:-null}" >>"$RES"
            echo "rep $rep c=$c $which: $m" >&2
        done
    done
done

status=0
python3 - "$RES" "$A" "$B" "$LOGS" "$REPS" "$SECS" >"$WORK/table.md" <<'EOF' || status=$?
import json, statistics, sys
res, a, b, logs, reps, secs = sys.argv[1:]
rows = [json.loads(l) for l in open(res)]
def med(which, c, field):
    v = [r["m"][field] for r in rows if r["which"] == which and r["conns"] == c and r["m"] and not
         (r["m"]["err_status"] or r["m"]["err_connect"] or r["m"]["err_read"] or r["m"]["err_write"])]
    return statistics.median(v) if v else None
print(f"A = {a}\nB = {b}\naccess log {logs}; {reps} repetitions of A B B A, {secs} s each; fenced 1 KiB PUTs\n")
print("| conns | A req/s | B req/s | B/A | A p99 ms | B p99 ms |")
print("|---|---|---|---|---|---|")
failed = False
for c in sorted({r["conns"] for r in rows}):
    ra, rb, pa, pb = med("a", c, "rps"), med("b", c, "rps"), med("a", c, "p99_us"), med("b", c, "p99_us")
    if None in (ra, rb, pa, pb):
        failed = True
        print(f"| {c} | failed | | | | |")
        continue
    print(f"| {c} | {ra:.0f} | {rb:.0f} | {rb / ra:.3f} | {pa / 1000:.2f} | {pb / 1000:.2f} |")
sys.exit(1 if failed else 0)
EOF
cat "$WORK/table.md"
if [ -n "$OUT" ]; then cp "$WORK/table.md" "$OUT"; fi
exit "$status"
