"""boto3 against a real S3 server (s3s-fs, which verifies SigV4) through a
fencegate S3 route. Run by tests/s3_sdk.rs, which starts both and passes
FG_PROXY, FG_API, S3_DIRECT, S3_AK, S3_SK. Every mutation kind: forwarded
with a live token, refused with a stale one (the object checked afterwards
directly on the server), the error readable in the SDK."""
import io
import os
import sys
import urllib.error
import urllib.request

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

import fencegate

PROXY, API, DIRECT = os.environ["FG_PROXY"], os.environ["FG_API"], os.environ["S3_DIRECT"]
AK, SK = os.environ["S3_AK"], os.environ["S3_SK"]
CFG = Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1})


def client(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=AK, aws_secret_access_key=SK,
                        region_name="us-east-1", config=CFG)


direct = client(DIRECT)
state = {"token": None, "tokens": None}
s3 = client(PROXY)
fencegate.boto3_hook(s3, lambda: state["token"], signed=True, tokens=lambda: state["tokens"])
unsigned = client(PROXY)
fencegate.boto3_hook(unsigned, lambda: state["token"], signed=False)
checks = 0


def live_and_stale(resource):
    old = fencegate.Lease.acquire(API, resource, ttl_ms=60_000)
    old.release()
    return fencegate.Lease.acquire(API, resource, ttl_ms=60_000), old.token


def refused(fn, code="StaleFencingToken", status=409):
    global checks
    try:
        fn()
    except ClientError as e:
        got = (e.response["Error"]["Code"], e.response["ResponseMetadata"]["HTTPStatusCode"])
        assert got == (code, status), f"expected {code}/{status}, got {got}: {e}"
        assert e.response["Error"].get("Message"), "the SDK shows the message"
        checks += 1
        return e
    raise AssertionError(f"expected {code}, but the call succeeded")


def body_of(bucket, key):
    return direct.get_object(Bucket=bucket, Key=key)["Body"].read()


def exists(bucket, key):
    try:
        direct.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError:
        return False


# CreateBucket: fenced on the bucket resource.
bucket_lease, bucket_stale = live_and_stale("bkt")
state["token"] = bucket_stale
refused(lambda: s3.create_bucket(Bucket="bkt"))
try:
    direct.head_bucket(Bucket="bkt")
    raise AssertionError("a refused CreateBucket created the bucket")
except ClientError:
    pass
state["token"] = None
refused(lambda: s3.create_bucket(Bucket="bkt"), "FencingTokenRequired", 428)
state["token"] = bucket_lease.token
s3.create_bucket(Bucket="bkt")
direct.head_bucket(Bucket="bkt")

# PutObject.
obj, obj_stale = live_and_stale("bkt/report.csv")
state["token"] = obj.token
s3.put_object(Bucket="bkt", Key="report.csv", Body=b"v1 by the holder")
state["token"] = obj_stale
e = refused(lambda: s3.put_object(Bucket="bkt", Key="report.csv", Body=b"zombie"))
assert "stale" in e.response["Error"]["Message"], e.response
assert body_of("bkt", "report.csv") == b"v1 by the holder"
# Unsigned header (before-send) is accepted the same way.
state["token"] = obj.token
unsigned.put_object(Bucket="bkt", Key="report.csv", Body=b"v2 unsigned")
state["token"] = obj_stale
refused(lambda: unsigned.put_object(Bucket="bkt", Key="report.csv", Body=b"zombie"))
assert body_of("bkt", "report.csv") == b"v2 unsigned"

# A key that needs encoding, and a signed GET of it (reads need no token).
odd, odd_stale = live_and_stale("bkt/dir/a+b c%.txt")
state["token"] = odd.token
s3.put_object(Bucket="bkt", Key="dir/a+b c%.txt", Body=b"odd")
state["token"] = None
assert s3.get_object(Bucket="bkt", Key="dir/a+b c%.txt")["Body"].read() == b"odd"
state["token"] = odd_stale
refused(lambda: s3.put_object(Bucket="bkt", Key="dir/a+b c%.txt", Body=b"zombie"))
assert body_of("bkt", "dir/a+b c%.txt") == b"odd"

# CopyObject: the destination is fenced, the source only read.
dst, dst_stale = live_and_stale("bkt/copy.csv")
state["token"] = dst_stale
refused(lambda: s3.copy_object(Bucket="bkt", Key="copy.csv", CopySource={"Bucket": "bkt", "Key": "report.csv"}))
assert not exists("bkt", "copy.csv")
state["token"] = dst.token
s3.copy_object(Bucket="bkt", Key="copy.csv", CopySource={"Bucket": "bkt", "Key": "report.csv"})
assert body_of("bkt", "copy.csv") == b"v2 unsigned"

# Multipart: create, parts, complete, abort.
mp, mp_stale = live_and_stale("bkt/big.bin")
state["token"] = mp_stale
refused(lambda: s3.create_multipart_upload(Bucket="bkt", Key="big.bin"))
state["token"] = mp.token
up = s3.create_multipart_upload(Bucket="bkt", Key="big.bin")["UploadId"]
part1 = b"a" * (5 * 1024 * 1024)
e1 = s3.upload_part(Bucket="bkt", Key="big.bin", UploadId=up, PartNumber=1, Body=part1)["ETag"]
state["token"] = mp_stale
refused(lambda: s3.upload_part(Bucket="bkt", Key="big.bin", UploadId=up, PartNumber=2, Body=b"zombie part"))
state["token"] = mp.token
e2 = s3.upload_part(Bucket="bkt", Key="big.bin", UploadId=up, PartNumber=2, Body=b"tail")["ETag"]
parts = {"Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]}
state["token"] = mp_stale
refused(lambda: s3.complete_multipart_upload(Bucket="bkt", Key="big.bin", UploadId=up, MultipartUpload=parts))
assert not exists("bkt", "big.bin")
state["token"] = mp.token
s3.complete_multipart_upload(Bucket="bkt", Key="big.bin", UploadId=up, MultipartUpload=parts)
assert body_of("bkt", "big.bin") == part1 + b"tail"
up2 = s3.create_multipart_upload(Bucket="bkt", Key="big.bin")["UploadId"]
state["token"] = mp_stale
refused(lambda: s3.abort_multipart_upload(Bucket="bkt", Key="big.bin", UploadId=up2))
state["token"] = mp.token
s3.abort_multipart_upload(Bucket="bkt", Key="big.bin", UploadId=up2)

# upload_fileobj (20 MiB, boto3's managed transfer, Expect: 100-continue).
data = os.urandom(20 * 1024 * 1024)
s3.upload_fileobj(io.BytesIO(data), "bkt", "big.bin")
assert body_of("bkt", "big.bin") == data
state["token"] = mp_stale
try:
    s3.upload_fileobj(io.BytesIO(b"z" * (6 * 1024 * 1024)), "bkt", "big.bin")
    raise AssertionError("a stale managed upload succeeded")
except ClientError as e:
    assert e.response["Error"]["Code"] == "StaleFencingToken", e.response
    checks += 1
assert body_of("bkt", "big.bin") == data

# DeleteObject.
state["token"] = dst_stale
refused(lambda: s3.delete_object(Bucket="bkt", Key="copy.csv"))
assert exists("bkt", "copy.csv")
state["token"] = dst.token
s3.delete_object(Bucket="bkt", Key="copy.csv")
assert not exists("bkt", "copy.csv")

# DeleteObjects: per-key tokens in X-Fencing-Tokens; one stale key refuses all.
leases = {}
for k in ["batch/1", "batch/2", "batch/3"]:
    g, stale = live_and_stale("bkt/" + k)
    leases[k] = (g, stale)
    state["token"], state["tokens"] = g.token, None
    s3.put_object(Bucket="bkt", Key=k, Body=k.encode())
state["token"] = None
batch = {"Objects": [{"Key": k} for k in leases]}
state["tokens"] = {"bkt/" + k: (s if k == "batch/2" else g.token) for k, (g, s) in leases.items()}
refused(lambda: s3.delete_objects(Bucket="bkt", Delete=batch))
assert all(exists("bkt", k) for k in leases), "a refused DeleteObjects deleted nothing"
state["tokens"] = {"bkt/" + k: g.token for k, (g, s) in list(leases.items())[:2]}
refused(lambda: s3.delete_objects(Bucket="bkt", Delete=batch), "FencingTokenRequired", 428)
state["tokens"] = {"bkt/" + k: g.token for k, (g, s) in leases.items()}
r = s3.delete_objects(Bucket="bkt", Delete=batch)
assert not r.get("Errors"), r
assert not any(exists("bkt", k) for k in leases)
state["tokens"] = None

# Presigned URLs: the token signed into the URL, or an unsigned header.
state["token"] = obj.token
url = s3.generate_presigned_url("put_object", Params={"Bucket": "bkt", "Key": "report.csv"}, ExpiresIn=300)
assert "x-fencing-token" in url.lower(), url


def put_url(url, body, headers):
    # urllib's default Content-Type for a body is a form's, which an
    # unsigned S3 request may not carry (docs/s3.md, "Only S3").
    headers = {"Content-Type": "application/octet-stream", **headers}
    req = urllib.request.Request(url, data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, b""
    except urllib.error.HTTPError as e:
        return e.code, e.read()


form = {"X-Fencing-Token": str(obj.token), "Content-Type": "application/x-www-form-urlencoded"}
status, body = put_url(url, b"Version=2009-04-15&Action=DeleteDomain", form)
assert status == 400 and b"<Code>BadRequest</Code>" in body, (status, body)
status, _ = put_url(url, b"v3 presigned", {"X-Fencing-Token": str(obj.token)})
assert status == 200, status
assert body_of("bkt", "report.csv") == b"v3 presigned"
state["token"] = obj_stale
stale_url = s3.generate_presigned_url("put_object", Params={"Bucket": "bkt", "Key": "report.csv"}, ExpiresIn=300)
status, body = put_url(stale_url, b"zombie", {"X-Fencing-Token": str(obj_stale)})
assert status == 409 and b"<Code>StaleFencingToken</Code>" in body, (status, body)
state["token"] = None
plain_url = s3.generate_presigned_url("put_object", Params={"Bucket": "bkt", "Key": "report.csv"}, ExpiresIn=300)
status, _ = put_url(plain_url, b"v4 presigned+header", {"X-Fencing-Token": str(obj.token)})
assert status == 200, status
status, body = put_url(plain_url, b"zombie", {"X-Fencing-Token": str(obj_stale)})
assert status == 409, status
status, body = put_url(plain_url, b"zombie", {})
assert status == 428 and b"FencingTokenRequired" in body, (status, body)
assert body_of("bkt", "report.csv") == b"v4 presigned+header"
checks += 3

# DeleteBucket: fenced on the bucket resource.
state["token"] = obj.token
for k in [o["Key"] for o in direct.list_objects_v2(Bucket="bkt").get("Contents", [])]:
    direct.delete_object(Bucket="bkt", Key=k)
state["token"] = bucket_stale
refused(lambda: s3.delete_bucket(Bucket="bkt"))
direct.head_bucket(Bucket="bkt")
state["token"] = bucket_lease.token
s3.delete_bucket(Bucket="bkt")

print(f"ok: {checks} refusals checked")
