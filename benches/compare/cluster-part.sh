# Part 6 of benches/compare/run.sh (sourced by it; uses its functions):
# cluster mode (issue 15) against etcd's own lock on the same 3-member
# etcd cluster, with the same load generator.
#
# Servers, all on the server CPU (the load generator and the backend on
# the other): etcd e1..e3 (one cluster); gateways gw1..gw3 in cluster mode
# on it (prefix /fg3/); gateway solo, a 1-gateway cluster on the same etcd
# (prefix /fg1/); gateway single, single-node mode (RocksDB). Every gateway
# forwards to the same nginx backend with the same route.
#
# Runs, interleaved per repetition:
# - lock cycles (acquire + release of a key of each client's own), 64
#   clients: fencegate-3gw (client i on gateway i mod 3), fencegate-1gw,
#   etcd-lock (v3lock Lock/Unlock over gRPC, a session lease per client),
#   etcd-txn (create-if-absent on the session lease + delete, over gRPC);
#   client i of the etcd targets talks to member i mod 3;
# - grant latency: 1 client cycling, fencegate-3gw (on gw1) and -1gw;
# - fenced 1 KiB PUTs (wrk, 32 connections) to gw1 and to single.
# etcd's counters (benches/compare/etcd_ops.py) are read around each run.

log "part 6: cluster mode, ${CLUSTER_REPS}x interleaved, ${D_CLUSTER}s per lock run, ${D_CLUSTER_PUT}s per PUT run"
# The backend first: its port must be taken before new free ports are drawn.
if [ -z "${PID[backend]:-}" ] || ! kill -0 "${PID[backend]}" 2>/dev/null; then
    start backend "$CPU_LOAD" nginx -p "$WORK" -e "$WORK/nginx-backend.err" -c "$WORK/nginx-backend.conf"
    wait_tcp "$P_BACKEND"
fi
# etcd_tails: the last lines of each member's log (why it is not healthy).
etcd_tails() {
    local i
    for i in 1 2 3; do
        echo "--- etcd$i (pid ${PID[etcd$i]:-?}, $(kill -0 "${PID[etcd$i]:-0}" 2>/dev/null && echo running || echo exited)):"
        tail -n 8 "$WORK/etcd$i.log" 2>/dev/null || true
    done
}

# etcd_cluster_up: waits up to 60 s until every member answers /health; stops
# early (status 1) when a member exited, e.g. because a port drawn as free was
# taken before it bound it.
etcd_cluster_up() {
    local deadline=$(($(date +%s) + 60)) i ok
    while [ "$(date +%s)" -lt "$deadline" ]; do
        for i in 1 2 3; do kill -0 "${PID[etcd$i]}" 2>/dev/null || return 1; done
        ok=0
        for i in 1 2 3; do
            curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:${CP[$((i - 1))]}/health" && ok=$((ok + 1))
        done
        [ "$ok" -eq 3 ] && return 0
        sleep 0.1
    done
    return 1
}

# Three members on ports drawn afresh for each attempt (and fresh data dirs):
# a member that exits is retried on new ports, at most three attempts.
for attempt in 1 2 3; do
    # shellcheck disable=SC2207
    CP=($(free_ports 16))
    E_URLS=""
    E_INIT=""
    for i in 1 2 3; do
        E_URLS+="${E_URLS:+,}http://127.0.0.1:${CP[$((i - 1))]}"
        E_INIT+="${E_INIT:+,}e$i=http://127.0.0.1:${CP[$((i + 2))]}"
    done
    for i in 1 2 3; do
        rm -rf "$WORK/etcd$i"
        start "etcd$i" "$CPU_SUT" etcd --name "e$i" --data-dir "$WORK/etcd$i" \
            --listen-client-urls "http://127.0.0.1:${CP[$((i - 1))]}" --advertise-client-urls "http://127.0.0.1:${CP[$((i - 1))]}" \
            --listen-peer-urls "http://127.0.0.1:${CP[$((i + 2))]}" --initial-advertise-peer-urls "http://127.0.0.1:${CP[$((i + 2))]}" \
            --initial-cluster "$E_INIT" --initial-cluster-state new --initial-cluster-token "fg-bench-$$-$attempt" \
            --logger zap --log-level warn
    done
    etcd_cluster_up && break
    log "  etcd cluster not up (attempt $attempt of 3): $E_URLS"
    etcd_tails | sed 's/^/    /'
    for i in 1 2 3; do stop "etcd$i"; done
    [ "$attempt" -lt 3 ] || die "the etcd cluster did not come up in 3 attempts"
done
E_ADDRS=$(echo "$E_URLS" | sed 's#http://##g')

# gateway NAME PROXY_PORT API_PORT [cluster-id prefix]: one gateway, same route for all.
gateway() {
    local name=$1 proxy=$2 api=$3 id=${4:-} prefix=${5:-}
    {
        if [ -n "$id" ]; then
            printf '[cluster]\netcd_endpoints = [%s]\ngateway_id = "%s"\nprefix = "%s"\n\n' \
                "$(echo "$E_URLS" | sed 's/[^,]*/"&"/g')" "$id" "$prefix"
        fi
        # A 1 s upstream timeout: the quarantine after a gateway's start is 1.5 s.
        printf '[[routes]]\nmatch = "/{*path}"\nupstream = "http://127.0.0.1:%s"\nupstream_timeout_ms = 1000\n' "$P_BACKEND"
    } >"$WORK/$name.toml"
    start "$name" "$CPU_SUT" "$FG" serve --config "$WORK/$name.toml" --data-dir "$WORK/$name" \
        --listen "127.0.0.1:$proxy" --api-listen "127.0.0.1:$api" --log-level warn
}
gateway gw1 "${CP[6]}" "${CP[7]}" gw1 /fg3/
gateway gw2 "${CP[8]}" "${CP[9]}" gw2 /fg3/
gateway gw3 "${CP[10]}" "${CP[11]}" gw3 /fg3/
gateway solo "${CP[12]}" "${CP[13]}" solo /fg1/
gateway single "${CP[14]}" "${CP[15]}"
for p in 7 9 11 13 15; do wait_http "http://127.0.0.1:${CP[$p]}/readyz" 60; done
sleep 2   # past the quarantine every gateway applies after its first read of the cluster
GW3_API="127.0.0.1:${CP[7]},127.0.0.1:${CP[9]},127.0.0.1:${CP[11]}"
log "  etcd $E_URLS; gateways gw1..gw3 $GW3_API, solo 127.0.0.1:${CP[13]}, single 127.0.0.1:${CP[15]}"

cluster_lock_addr() {
    case "$1" in
        fencegate-3gw) echo "fencegate $GW3_API" ;;
        fencegate-3gw-on-gw1) echo "fencegate 127.0.0.1:${CP[7]}" ;;
        fencegate-1gw) echo "fencegate 127.0.0.1:${CP[13]}" ;;
        etcd-lock) echo "etcd-lock $E_ADDRS" ;;
        etcd-txn) echo "etcd-txn $E_ADDRS" ;;
    esac
}
etcd_snap() { python3 "$HERE/etcd_ops.py" snap ${E_URLS//,/ }; }

# cluster_run KIND TARGET CLIENTS REP: one lock run, recorded with etcd's counters.
cluster_run() {
    local kind=$1 t=$2 c=$3 rep=$4 before after ops r
    before=$(etcd_snap)
    # shellcheck disable=SC2046
    r=$(measure "" loadgen lock $(cluster_lock_addr "$t") --op cycle --clients "$c" --secs "$D_CLUSTER" --prefix "k$kind$rep/")
    after=$(etcd_snap)
    ops=$(python3 "$HERE/etcd_ops.py" diff "$before" "$after")
    record "\"part\":\"cluster\",\"kind\":\"$kind\",\"target\":\"$t\",\"clients\":$c,\"rep\":$rep,\"etcd_ops\":$ops" "$r"
    log "  rep $rep $kind c=$c $t: $(printf '%s' "$r" | cut -c1-170)"
}

CLUSTER_TARGETS="fencegate-3gw fencegate-1gw etcd-lock etcd-txn"
for t in $CLUSTER_TARGETS; do   # warm-up, not recorded
    # shellcheck disable=SC2046
    loadgen lock $(cluster_lock_addr "$t") --op cycle --clients 8 --secs 0.5 --prefix warm/ >/dev/null ||
        log "  warm-up of $t failed"
done
TOK_GW=$(acquire_token "${CP[7]}" bench/obj)
TOK_SINGLE=$(acquire_token "${CP[15]}" bench/obj)
for rep in $(seq "$CLUSTER_REPS"); do
    for t in $CLUSTER_TARGETS; do cluster_run cycles "$t" 64 "$rep"; done
    for t in fencegate-3gw-on-gw1 fencegate-1gw; do cluster_run latency "$t" 1 "$rep"; done
    for t in cluster single; do
        if [ "$t" = cluster ]; then url="http://127.0.0.1:${CP[6]}/bench/obj" tok=$TOK_GW; else url="http://127.0.0.1:${CP[14]}/bench/obj" tok=$TOK_SINGLE; fi
        r=$(measure "" wrk_put 32 "$D_CLUSTER_PUT" "$url" FENCING_TOKEN="$tok")
        record "\"part\":\"cluster-put\",\"target\":\"$t\",\"conns\":32,\"rep\":$rep" "$r"
        log "  rep $rep fenced PUT c=32 $t: $(printf '%s' "$r" | cut -c1-150)"
    done
done
for n in single solo gw3 gw2 gw1 etcd3 etcd2 etcd1; do stop "$n"; done
stop backend
