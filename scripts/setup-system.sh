#!/usr/bin/env bash
# Installs the Debian packages fencegate needs, only those missing.
# Usage: scripts/setup-system.sh [build|test]   (idempotent; needs root or sudo)
set -euo pipefail

mode="${1:-build}"
packages=(libclang-dev)            # RocksDB's bindings are generated with bindgen
packages+=(protobuf-compiler)      # etcd-client (cluster mode) generates its gRPC code with protoc
packages+=(libprotobuf-dev)        # ... and imports protobuf's well-known types (a Recommends of protobuf-compiler, which --no-install-recommends skips)
if [ "$mode" = "test" ]; then
  packages+=(procps)               # kill(1) for the crash and restart tests
  packages+=(prometheus)           # real Prometheus + promtool check the dashboard and alert rules
  packages+=(curl python3)         # unmodified programs fenced by `fencegate lock --inject`
  packages+=(python3-venv)         # the S3 tests' venv (boto3, awscli): scripts/setup-s3.sh
  packages+=(iproute2)             # the nemesis partitions a client with a network namespace
  packages+=(etcd-server)          # cluster mode's tests run a real 3-member etcd cluster (3.4.23)
  packages+=(etcd-client)          # etcdctl, for scripts/cluster.sh and operators
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
