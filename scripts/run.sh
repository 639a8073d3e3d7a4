#!/usr/bin/env bash
# Builds fencegate and runs it on its embedded defaults (proxy 127.0.0.1:8080,
# api 127.0.0.1:7070, data in ./fencegate-data). Extra arguments go to `serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-system.sh build
exec cargo run --locked --bin fencegate -- serve "$@"
