#!/usr/bin/env bash
# Installs what the tests need and runs the whole test suite: unit tests,
# in-process tests, the real binary against real upstreams, kill -9 crash
# tests, and every criterion bench once in test mode (so none can rot).
# Honours CARGO_TARGET_DIR (a shared one reuses the compiled RocksDB).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-system.sh test

started=$(date +%s)
# One profile for everything, so RocksDB's C++ is compiled once per run.
cargo build --locked --all-targets
echo "build: $(( $(date +%s) - started )) s"
cargo clippy --locked --all-targets --no-deps -- -D warnings
cargo test --locked --lib --bins --tests --examples -- --test-threads="${FENCEGATE_TEST_THREADS:-4}"
# Criterion benches, once each in test mode (cargo test passes no --bench).
cargo test --locked --benches
echo "tests: $(( $(date +%s) - started )) s in all"
