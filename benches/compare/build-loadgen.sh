#!/usr/bin/env bash
# Builds the side-by-side load generator (benches/compare/loadgen, release)
# and prints the path of its binary. Extra arguments go to cargo (CI builds
# it on one core beside the nemesis: `build-loadgen.sh -j 1`).
# A shared CARGO_TARGET_DIR gets a subdirectory of its own (reused across
# clones); without one it builds in loadgen/target.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
target=${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/compare-loadgen}
target=${target:-$HERE/loadgen/target}
(cd "$HERE/loadgen" && CARGO_TARGET_DIR="$target" cargo build --quiet --release "$@")
echo "$target/release/loadgen"
