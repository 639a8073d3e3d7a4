#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time.
#
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# SECONDS_PER_TARGET defaults to 60; TARGETs default to all of them. Seeds
# in fuzz/seeds/<target>/ (committed) are copied into fuzz/corpus/<target>/
# (not committed, kept between runs) before each run. Prints the number of
# executions each target reached, and exits non-zero if any target crashed
# (panic, failed assertion, sanitizer report, timeout or out-of-memory);
# the crashing input is then in fuzz/artifacts/<target>/.
#
# Builds on stable Rust: RUSTC_BOOTSTRAP=1 lets it take cargo-fuzz's -Z
# flags. FUZZ_SANITIZER=none|address (default address) picks the
# sanitizer; the targets are always built with debug assertions and
# overflow checks. fencegate is built without its rocksdb feature here, so
# no C++ is compiled. Logs: fuzz/target/fuzz-logs/<target>.log.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

secs="${1:-60}"
shift || true
case "$secs" in
    '' | *[!0-9]*) echo "usage: $0 [SECONDS_PER_TARGET] [TARGET...]" >&2; exit 2 ;;
esac
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(token_header path_key route_template config json_bodies)
fi
sanitizer="${FUZZ_SANITIZER:-address}"
cargo_fuzz_version="0.13.2"

export RUSTC_BOOTSTRAP=1
export PATH="$HOME/.cargo/bin:$PATH"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz $cargo_fuzz_version"
    cargo install cargo-fuzz --locked --version "$cargo_fuzz_version"
fi

start=$(date +%s)
fuzz_target_dir="$root/fuzz/target"
build_opts=(-O -a -s "$sanitizer" --target-dir "$fuzz_target_dir")

echo "== building ${#targets[@]} fuzz target(s) (sanitizer: $sanitizer, debug assertions on)"
for t in "${targets[@]}"; do
    cargo fuzz build "${build_opts[@]}" "$t"
done

logs="$fuzz_target_dir/fuzz-logs"
mkdir -p "$logs"
declare -A execs result
failed=0
for t in "${targets[@]}"; do
    corpus="fuzz/corpus/$t"
    mkdir -p "$corpus" "fuzz/artifacts/$t"
    if [ -d "fuzz/seeds/$t" ]; then
        cp -n fuzz/seeds/"$t"/* "$corpus"/ 2>/dev/null || true
    fi
    flags=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1)
    if [ -f "fuzz/dicts/$t.dict" ]; then
        flags+=(-dict="fuzz/dicts/$t.dict")
    fi
    echo "== $t: ${secs}s"
    rc=0
    # The outer timeout only guards against a hung libFuzzer process.
    timeout --kill-after=30 $((secs + 300)) \
        cargo fuzz run "${build_opts[@]}" "$t" "$corpus" -- "${flags[@]}" >"$logs/$t.log" 2>&1 || rc=$?
    n=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$logs/$t.log" | tail -n1)
    if [ -z "$n" ]; then
        n=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$logs/$t.log" | tail -n1)
    fi
    if [ -z "$n" ]; then
        # A crash stops before the final stats; the last status line counts.
        n=$(grep -o '^#[0-9]*' "$logs/$t.log" | tail -n1 | tr -d '#')
    fi
    execs[$t]="${n:-?}"
    if [ "$rc" -eq 0 ]; then
        result[$t]="ok"
    else
        failed=1
        result[$t]="CRASH (exit $rc)"
        echo "-- $t failed (exit $rc); end of $logs/$t.log:"
        tail -n 40 "$logs/$t.log"
        grep -h 'Test unit written to' "$logs/$t.log" || true
        echo "-- reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run ${build_opts[*]} $t fuzz/artifacts/$t/<file>"
        echo "-- minimise:  RUSTC_BOOTSTRAP=1 cargo fuzz tmin ${build_opts[*]} $t fuzz/artifacts/$t/<file>"
    fi
    echo "   $t: ${execs[$t]} executions, ${result[$t]}"
done

echo
echo "== summary (${secs}s per target, sanitizer $sanitizer, $(($(date +%s) - start))s wall)"
for t in "${targets[@]}"; do
    printf '%-16s %12s executions  %s\n' "$t" "${execs[$t]}" "${result[$t]}"
done
exit "$failed"
