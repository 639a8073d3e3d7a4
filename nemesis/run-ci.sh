#!/usr/bin/env bash
# Nemesis run for CI (issue 7): a short fenced run under every default fault,
# then the self-test against a deliberately unfenced gateway (shadow mode);
# then the same two for the S3 mode (issue 16: s3s-fs behind an S3 route);
# then both in cluster mode (issue 15).
# Fails if the fenced run shows any anomaly, or if the self-test shows none,
# or none of the sequence rule, or (S3) none in the objects s3s-fs held, or
# (cluster) no superseded-applied (a checker that cannot catch a broken
# gateway proves nothing).
#
#   bash nemesis/run-ci.sh
#
# Environment (all optional):
#   FENCEGATE_BIN               gateway binary (default: cargo build --bin fencegate, target/debug/fencegate)
#   NEMESIS_DURATION            seconds of the fenced run (default 75)
#   NEMESIS_SELFTEST_DURATION   seconds of the unfenced self-test (default 30)
#   NEMESIS_SEED                seed of the fenced run (default: random, printed)
#   NEMESIS_OUT                 where histories and logs go (default: a new /tmp directory)
#   NEMESIS_S3_DURATION         seconds of the fenced S3 run (default 48)
#   NEMESIS_S3_SELFTEST_DURATION  seconds of the S3 mode's unfenced self-test (default 25)
#   NEMESIS_CLUSTER_DURATION    seconds of the cluster-mode run (default 60)
#   NEMESIS_CLUSTER_SELFTEST_DURATION  seconds of its self-test (default 40)
#
# Then the same in cluster mode (nemesis/cluster.py: 3 etcd members, 3
# gateways): a fenced run under etcd and gateway faults, and its self-test
# against gateways that do not self-fence (the no-self-fencing fault of
# src/fault.rs, debug builds only).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${FENCEGATE_BIN:-}" ]; then
    cargo build --bin fencegate || exit 2
    FENCEGATE_BIN="$PWD/target/debug/fencegate"
fi
echo "== nemesis: checker unit tests =="
python3 -m unittest nemesis/test_checker.py nemesis/test_s3checker.py || exit 1

OUT="${NEMESIS_OUT:-$(mktemp -d /tmp/fencegate-nemesis-ci.XXXXXX)}"
mkdir -p "$OUT"
started=$(date +%s)

echo "== nemesis: fenced run (${NEMESIS_DURATION:-75} s, every default fault) =="
# A 75 s run has room for about five faults of the nine: the clean stop
# with a write in flight (issue 19) and the same-holder retry (issue 17)
# run first whatever the seed, the rest are shuffled.
timeout --signal=TERM --kill-after=30 $(( ${NEMESIS_DURATION:-75} + 300 )) \
    python3 nemesis/harness.py --duration "${NEMESIS_DURATION:-75}" --binary "$FENCEGATE_BIN" \
    --out "$OUT/fenced" ${NEMESIS_SEED:+--seed "$NEMESIS_SEED"} --first-faults gateway-stop-during-stall,holder-retry
fenced=$?

echo
echo "== nemesis: self-test against an unfenced gateway (shadow mode, ${NEMESIS_SELFTEST_DURATION:-30} s) =="
# The faults that make zombie writers (paused holders, stepped lease clocks,
# a client cut off mid-request), one after the other with short gaps, and
# first a same-holder retry: shadow mode forwards the retried write the
# sequence rule refuses, and the checker must report it (sequence-order).
timeout --signal=TERM --kill-after=30 $(( ${NEMESIS_SELFTEST_DURATION:-30} + 300 )) \
    python3 nemesis/harness.py --unfenced --duration "${NEMESIS_SELFTEST_DURATION:-30}" \
    --binary "$FENCEGATE_BIN" --out "$OUT/unfenced" --faults pause,clock-step,partition,holder-retry \
    --first-faults holder-retry --quiet-gap 1
selftest=$?
seqorder=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("anomalies_by_kind", {}).get("sequence-order", 0))' \
    "$OUT/unfenced/summary.json" 2>/dev/null || echo 0)

echo
echo "== nemesis S3 mode: fenced run against s3s-fs (${NEMESIS_S3_DURATION:-48} s) =="
# s3s-fs (SigV4-verifying) behind an S3 route, boto3 clients doing fenced
# PutObject, multipart uploads, DeleteObject and DeleteObjects. A 48 s run
# has room for three faults: the GC pause (a holder frozen mid-upload or
# between its read and its write), kill -9 of the gateway and a clean
# restart, whatever the seed; the other S3 faults are in the soak.
bash scripts/setup-s3.sh >/dev/null || { echo "FAIL: scripts/setup-s3.sh (s3s-fs, boto3) failed"; exit 2; }
timeout --signal=TERM --kill-after=30 $(( ${NEMESIS_S3_DURATION:-48} + 300 )) \
    python3 nemesis/harness.py --s3 --duration "${NEMESIS_S3_DURATION:-48}" --binary "$FENCEGATE_BIN" \
    --out "$OUT/s3-fenced" ${NEMESIS_SEED:+--seed "$NEMESIS_SEED"} --first-faults pause,gateway-kill,gateway-restart
s3fenced=$?

echo
echo "== nemesis S3 mode: self-test against an unfenced S3 route (shadow mode, ${NEMESIS_S3_SELFTEST_DURATION:-25} s) =="
# Holders frozen between their read and their write or mid-upload, one
# after the other: shadow mode forwards their stale writes, parts and
# deletes, and the checker must see them in what s3s-fs wrote and acknowledged.
timeout --signal=TERM --kill-after=30 $(( ${NEMESIS_S3_SELFTEST_DURATION:-25} + 300 )) \
    python3 nemesis/harness.py --s3 --unfenced --duration "${NEMESIS_S3_SELFTEST_DURATION:-25}" \
    --binary "$FENCEGATE_BIN" --out "$OUT/s3-unfenced" --faults pause --quiet-gap 1
s3selftest=$?
s3objects=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("object_anomalies", 0))' \
    "$OUT/s3-unfenced/summary.json" 2>/dev/null || echo 0)
echo "== nemesis: cluster mode, fenced run (${NEMESIS_CLUSTER_DURATION:-60} s: 3 etcd members, 3 gateways) =="
# The faults the issue names, the ones only a cluster has first: gateway 3
# cut from etcd, the etcd leader killed, a gateway stopped past its member
# TTL mid-forward, a gateway killed mid-forward, a compaction, the etcd
# leader stopped, a follower killed (as many as fit).
timeout --signal=TERM --kill-after=30 $(( ${NEMESIS_CLUSTER_DURATION:-60} + 360 )) \
    python3 nemesis/cluster.py --duration "${NEMESIS_CLUSTER_DURATION:-60}" --binary "$FENCEGATE_BIN" \
    --out "$OUT/cluster" ${NEMESIS_SEED:+--seed "$NEMESIS_SEED"} --quiet-gap 2 \
    --first-faults gateway-partition,etcd-leader-kill,gateway-stop,gateway-kill,etcd-compact,etcd-leader-stop,etcd-follower-kill
cluster=$?

echo
echo "== nemesis: cluster self-test against gateways that do not self-fence (${NEMESIS_CLUSTER_SELFTEST_DURATION:-40} s) =="
# Gateway 3, cut from etcd, is asked to admit a write with a token a grant
# through gateway 1 superseded meanwhile: a gateway that self-fences refuses
# it (503 not_current); these do not, and the checker must say so.
timeout --signal=TERM --kill-after=30 $(( ${NEMESIS_CLUSTER_SELFTEST_DURATION:-40} + 360 )) \
    python3 nemesis/cluster.py --broken no-self-fencing --duration "${NEMESIS_CLUSTER_SELFTEST_DURATION:-40}" \
    --binary "$FENCEGATE_BIN" --out "$OUT/cluster-broken" --faults gateway-partition --quiet-gap 1
cluster_selftest=$?
superseded=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("anomalies_by_kind", {}).get("superseded-applied", 0))' \
    "$OUT/cluster-broken/summary.json" 2>/dev/null || echo 0)

echo
echo "== nemesis: $(( $(date +%s) - started )) s; histories in $OUT =="
status=0
if [ "$fenced" -ne 0 ]; then
    echo "FAIL: the fenced run exited $fenced (1 = anomalies, 2 = harness failure); see $OUT/fenced/summary.txt"
    status=1
else
    echo "ok: fenced run, no anomalies"
fi
if [ "$selftest" -ne 0 ]; then
    echo "FAIL: the self-test exited $selftest (1 = the checker found no anomaly in an unfenced gateway)"
    status=1
else
    echo "ok: self-test, the checker caught the unfenced gateway"
fi
if [ "$seqorder" -gt 0 ] 2>/dev/null; then
    echo "ok: self-test, $seqorder sequence-order anomalies (the sequence rule ignored in shadow mode)"
else
    echo "FAIL: the self-test found no sequence-order anomaly (the holder-retry fault did not catch the gateway that ignores X-Fencing-Sequence)"
    status=1
fi
if [ "$s3fenced" -ne 0 ]; then
    echo "FAIL: the fenced S3 run exited $s3fenced (1 = anomalies, 2 = harness failure); see $OUT/s3-fenced/summary.txt"
    status=1
else
    echo "ok: fenced S3 run, no anomalies"
fi
if [ "$s3selftest" -ne 0 ]; then
    echo "FAIL: the S3 self-test exited $s3selftest (1 = the checker found no anomaly in an unfenced S3 route)"
    status=1
else
    echo "ok: S3 self-test, the checker caught the unfenced S3 route"
fi
if [ "$s3objects" -gt 0 ] 2>/dev/null; then
    echo "ok: S3 self-test, $s3objects anomalies seen in what s3s-fs held (stale writes in objects, acknowledged writes lost)"
else
    echo "FAIL: the S3 self-test found no anomaly in the objects s3s-fs held (only in the gateway's answers)"
    status=1
fi
if [ "$cluster" -ne 0 ]; then
    echo "FAIL: the cluster run exited $cluster (1 = anomalies, 2 = harness failure); see $OUT/cluster/summary.txt"
    status=1
else
    echo "ok: cluster run, no anomalies"
fi
if [ "$cluster_selftest" -ne 0 ] || ! [ "$superseded" -gt 0 ] 2>/dev/null; then
    echo "FAIL: the cluster self-test exited $cluster_selftest with $superseded superseded-applied anomalies (the checker must catch gateways that do not self-fence)"
    status=1
else
    echo "ok: cluster self-test, $superseded superseded-applied anomalies from gateways that do not self-fence"
fi
exit $status
