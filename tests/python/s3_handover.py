"""Hand-overs on S3, with zombies, checked from what the store holds.

Six writers contend for three objects on an S3 route in front of s3s-fs.
Each takes the object's lock (300 ms TTL, waiting up to 3 s), writes it
three times (PutObject, body "writer:token:n"), and every third round
pauses 600 ms before its last write — past its lease, so another writer
takes over meanwhile: a zombie. Then two properties are checked:

1. No write was acknowledged (200) that was sent after a newer grant of
   its object had been returned to some writer: the fence moved before
   that grant was returned, so the write must have been refused.
2. Each object's final content is the last acknowledged write of the
   highest token acknowledged on it (nothing older landed after it).

With --expect-anomaly (a shadow-mode route: enforce = false) the run must
find at least one violation: the checker catches an unfenced gateway.
Environment: FG_PROXY, FG_API, S3_DIRECT, S3_AK, S3_SK.
"""
import os
import random
import sys
import threading
import time

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, FlexibleChecksumError

import fencegate

PROXY, API, DIRECT = os.environ["FG_PROXY"], os.environ["FG_API"], os.environ["S3_DIRECT"]
AK, SK = os.environ["S3_AK"], os.environ["S3_SK"]
CFG = Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1},
             max_pool_connections=4)
KEYS = ["obj0", "obj1", "obj2"]
ROUNDS = int(os.environ.get("ROUNDS", "6"))


def client(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=AK, aws_secret_access_key=SK,
                        region_name="us-east-1", config=CFG)


lock = threading.Lock()
grants = []   # (key, token, time the grant was returned)
writes = []   # (key, token, body, sent, status)
errors = []


def writer(w):
    rng = random.Random(w)
    state = {"token": None}
    s3 = client(PROXY)
    fencegate.boto3_hook(s3, lambda: state["token"])
    for rnd in range(ROUNDS):
        key = KEYS[(w + rnd) % len(KEYS)]
        try:
            lease = fencegate.Lease.acquire(API, "bkt/" + key, ttl_ms=300, wait_ms=3000, holder=f"w{w}")
        except fencegate.LeaseError:
            continue
        with lock:
            grants.append((key, lease.token, time.monotonic()))
        state["token"] = lease.token
        zombie = rnd % 3 == w % 3
        if zombie:
            lease.stop_renewing()
        for n in range(3):
            if zombie and n == 2:
                time.sleep(0.6)  # a pause past the lease: someone else takes over
            else:
                time.sleep(rng.uniform(0, 0.03))
            body = f"w{w}:{lease.token}:{n}".encode()
            sent = time.monotonic()
            try:
                s3.put_object(Bucket="bkt", Key=key, Body=body)
                status = 200
            except ClientError as e:
                status = e.response["ResponseMetadata"]["HTTPStatusCode"]
            except Exception as e:  # noqa: BLE001 - recorded, fails the run
                errors.append(repr(e))
                status = 0
            with lock:
                writes.append((key, lease.token, body, sent, status))
        if not zombie:
            lease.release()


def main():
    expect_anomaly = "--expect-anomaly" in sys.argv
    admin = fencegate.Lease.acquire(API, "bkt", ttl_ms=10_000)
    s3 = client(PROXY)
    fencegate.boto3_hook(s3, admin)
    s3.create_bucket(Bucket="bkt")
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    direct = client(DIRECT)
    anomalies = []
    for key, token, body, sent, status in writes:
        newer = [g for g in grants if g[0] == key and g[1] > token and g[2] < sent]
        if status == 200 and newer:
            anomalies.append(f"{key}: write {body!r} (token {token}) acknowledged though token {newer[0][1]} "
                             f"had been granted before it was sent")
    for key in KEYS:
        acked = [w for w in writes if w[0] == key and w[4] == 200]
        if not acked:
            continue
        top = max(w[1] for w in acked)
        last = [w for w in acked if w[1] == top][-1][2]
        # Two unfenced writers racing on one key can leave the store with one
        # write's body and the other's checksum: a torn object, itself an anomaly.
        try:
            final = direct.get_object(Bucket="bkt", Key=key)["Body"].read()
        except FlexibleChecksumError as e:
            anomalies.append(f"{key}: torn object, its body does not match its stored checksum ({e})")
            continue
        if final != last:
            anomalies.append(f"{key}: holds {final!r}, not {last!r}, the last write of the highest token {top}")
    refused = sum(1 for w in writes if w[4] == 409)
    acked = sum(1 for w in writes if w[4] == 200)
    print(f"{len(grants)} grants, {len(writes)} writes: {acked} acknowledged, {refused} refused (409), "
          f"{len(anomalies)} anomalies, {len(errors)} errors")
    for a in anomalies[:10]:
        print("  anomaly:", a)
    for e in errors[:5]:
        print("  error:", e)
    if errors:
        sys.exit(2)
    if expect_anomaly:
        sys.exit(0 if anomalies else 1)
    sys.exit(1 if anomalies or refused == 0 else 0)


if __name__ == "__main__":
    main()
