#!/usr/bin/env bash
# Starts a cluster-mode playground on loopback: 3 etcd members and 3
# gateways sharing them, for a person to try with curl. Ctrl-C stops
# everything it started (by PID).
#
# Usage: scripts/cluster.sh [BINARY]   (default: target/release/fencegate,
#        else target/debug/fencegate). Needs the etcd-server package.
# Ports: etcd clients 23791-23793, gateways' APIs 7071-7073 and proxies
# 8081-8083 (set BASE_API / BASE_PROXY / BASE_ETCD to move them).
set -euo pipefail

bin="${1:-}"
if [ -z "$bin" ]; then
  for b in target/release/fencegate target/debug/fencegate; do
    [ -x "$b" ] && bin="$b" && break
  done
fi
[ -x "${bin:-}" ] || { echo "build fencegate first (cargo build --release), or pass its path" >&2; exit 2; }
command -v etcd >/dev/null || { echo "etcd not found: install the etcd-server package" >&2; exit 2; }

BASE_ETCD="${BASE_ETCD:-23790}"
BASE_API="${BASE_API:-7070}"
BASE_PROXY="${BASE_PROXY:-8080}"
dir="$(mktemp -d -t fencegate-cluster.XXXXXX)"
pids=()
stopped=""
stop() {
  [ -n "$stopped" ] && return
  stopped=1
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # An etcd leader may linger on SIGTERM (it tries to hand over its
  # leadership to members that are gone): SIGKILL after 5 s.
  for _ in $(seq 1 50); do
    alive=""
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  echo "stopped; logs and data kept in $dir"
}
trap stop EXIT
trap 'exit 130' INT TERM

initial=""
for i in 1 2 3; do
  initial+="${initial:+,}e$i=http://127.0.0.1:$((BASE_ETCD + 10 + i))"
done
endpoints=""
for i in 1 2 3; do
  client="http://127.0.0.1:$((BASE_ETCD + i))"
  endpoints+="${endpoints:+,}$client"
  etcd --name "e$i" --data-dir "$dir/e$i" \
    --listen-client-urls "$client" --advertise-client-urls "$client" \
    --listen-peer-urls "http://127.0.0.1:$((BASE_ETCD + 10 + i))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((BASE_ETCD + 10 + i))" \
    --initial-cluster "$initial" --initial-cluster-state new \
    --initial-cluster-token fencegate-playground 2>"$dir/e$i.log" &
  pids+=($!)
done

# The members elect a leader before the gateways start: a gateway that
# cannot read its cluster within its etcd timeout at start exits.
for _ in $(seq 1 300); do
  healthy=0
  for i in 1 2 3; do
    curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$((BASE_ETCD + i))/health" && healthy=$((healthy + 1))
  done
  [ "$healthy" -eq 3 ] && break
  sleep 0.1
done
[ "$healthy" -eq 3 ] || { echo "the etcd members did not become healthy within 30 s; logs in $dir" >&2; exit 1; }

# One shared directory behind all three gateways (they run on one
# machine): a per-gateway file:// route on purpose.
mkdir -p "$dir/objects"
for i in 1 2 3; do
  cat >"$dir/gw$i.toml" <<TOML
[cluster]
etcd_endpoints = [$(echo "$endpoints" | sed 's/[^,]*/"&"/g')]
gateway_id = "gw$i"

[[routes]]
match = "/{*path}"
upstream = "file://$dir/objects"
per_gateway = true
TOML
  "$bin" serve --config "$dir/gw$i.toml" --data-dir "$dir/gw$i" \
    --listen "127.0.0.1:$((BASE_PROXY + i))" --api-listen "127.0.0.1:$((BASE_API + i))" 2>"$dir/gw$i.log" &
  pids+=($!)
done

for i in 1 2 3; do
  for _ in $(seq 1 100); do
    grep -q "fencegate serving" "$dir/gw$i.log" 2>/dev/null && break
    sleep 0.1
  done
  grep -q "fencegate serving" "$dir/gw$i.log" || { echo "gateway $i did not start:"; cat "$dir/gw$i.log"; exit 1; }
done

cat <<TXT
3 etcd members: $endpoints
3 gateways: lease APIs http://127.0.0.1:$((BASE_API + 1)) .. $((BASE_API + 3)), proxies http://127.0.0.1:$((BASE_PROXY + 1)) .. $((BASE_PROXY + 3))

  curl -s -XPOST localhost:$((BASE_API + 1))/v1/locks/acquire -d '{"key":"doc","ttl_ms":10000}'
  curl -s -XPUT localhost:$((BASE_PROXY + 2))/doc -H 'X-Fencing-Token: TOKEN' -d v1
  curl -s -XPOST localhost:$((BASE_API + 3))/v1/locks/acquire -d '{"key":"doc","ttl_ms":10000,"wait_ms":15000}'
  curl -s -XPUT localhost:$((BASE_PROXY + 1))/doc -H 'X-Fencing-Token: OLD_TOKEN' -d stale   # 409 on every gateway

Logs: $dir. Ctrl-C stops everything.
TXT
wait
