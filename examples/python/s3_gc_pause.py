#!/usr/bin/env python3
"""The GC-pause story on S3, with boto3 and a real S3 server.

Writer A holds the lock on bkt/video.mp4 and streams a multipart upload. In
the middle it freezes (a GC pause, a stopped VM) past its lease. Writer B
takes the lock over and writes the object. A wakes up and carries on: its
remaining part and its CompleteMultipartUpload are refused with
StaleFencingToken before they reach the store, and the object is B's.

Starts its own s3s-fs and gateway. Needs boto3 and the fencegate client
(`bash scripts/setup-s3.sh` puts both in .venv):

    .venv/bin/python examples/python/s3_gc_pause.py

FENCEGATE_BIN (default target/debug/fencegate) and S3S_FS (default s3s-fs
on PATH or in ~/.cargo/bin) name the binaries.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

import fencegate

HERE = os.path.dirname(os.path.abspath(__file__))
AK, SK = "example-ak", "example-secret-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port):
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def s3_client(endpoint, lease_token):
    c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=AK, aws_secret_access_key=SK,
                     region_name="us-east-1",
                     config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                                   retries={"max_attempts": 1}))
    fencegate.boto3_hook(c, lease_token)  # signed into every request
    return c


def main():
    binary = os.environ.get("FENCEGATE_BIN", os.path.join(HERE, "..", "..", "target", "debug", "fencegate"))
    s3s = os.environ.get("S3S_FS") or shutil.which("s3s-fs") or os.path.expanduser("~/.cargo/bin/s3s-fs")
    work = tempfile.mkdtemp(prefix="fencegate-s3-")
    os.makedirs(os.path.join(work, "s3"))
    s3_port, proxy, api_port = free_port(), free_port(), free_port()
    store = subprocess.Popen([s3s, "--host", "127.0.0.1", "--port", str(s3_port), "--access-key", AK,
                              "--secret-key", SK, os.path.join(work, "s3")], stderr=subprocess.DEVNULL)
    config = os.path.join(work, "fencegate.toml")
    with open(config, "w") as f:
        f.write(f'[[routes]]\nname = "s3"\nkind = "s3"\nupstream = "http://127.0.0.1:{s3_port}"\n')
    gw = subprocess.Popen([binary, "serve", "--data-dir", os.path.join(work, "data"), "--listen",
                           f"127.0.0.1:{proxy}", "--api-listen", f"127.0.0.1:{api_port}", "--config", config],
                          stderr=subprocess.DEVNULL)
    api, endpoint = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{proxy}"
    ok = False
    try:
        wait_port(s3_port), wait_port(proxy), wait_port(api_port)
        with fencegate.Lease.acquire(api, "bkt", ttl_ms=5000, holder="admin") as admin:
            s3_client(endpoint, admin).create_bucket(Bucket="bkt")

        a = fencegate.Lease.acquire(api, "bkt/video.mp4", ttl_ms=1000, holder="writer-a")
        s3a = s3_client(endpoint, a)
        up = s3a.create_multipart_upload(Bucket="bkt", Key="video.mp4")["UploadId"]
        part1 = b"A" * (5 * 1024 * 1024)
        e1 = s3a.upload_part(Bucket="bkt", Key="video.mp4", UploadId=up, PartNumber=1, Body=part1)["ETag"]
        print(f"writer A (token {a.token}) uploaded part 1 of its multipart upload")
        a.stop_renewing()  # A freezes: no renewals, no progress
        print("writer A pauses (GC) past its 1 s lease ...")

        b = fencegate.Lease.acquire(api, "bkt/video.mp4", ttl_ms=10_000, wait_ms=5000, holder="writer-b")
        s3b = s3_client(endpoint, b)
        s3b.put_object(Bucket="bkt", Key="video.mp4", Body=b"B's complete video")
        print(f"writer B (token {b.token}) took the lock over and wrote the object")

        print(f"writer A wakes up (lost = {a.lost}) and carries on with token {a.token}:")
        refusals = 0
        try:
            s3a.upload_part(Bucket="bkt", Key="video.mp4", UploadId=up, PartNumber=2, Body=b"A's tail")
        except ClientError as e:
            refusals += e.response["Error"]["Code"] == "StaleFencingToken"
            print(f"  part 2 -> HTTP {e.response['ResponseMetadata']['HTTPStatusCode']} "
                  f"{e.response['Error']['Code']}: {e.response['Error']['Message']}")
        try:
            s3a.complete_multipart_upload(Bucket="bkt", Key="video.mp4", UploadId=up,
                                          MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e1}]})
        except ClientError as e:
            refusals += e.response["Error"]["Code"] == "StaleFencingToken"
            print(f"  CompleteMultipartUpload -> HTTP {e.response['ResponseMetadata']['HTTPStatusCode']} "
                  f"{e.response['Error']['Code']}")
        body = s3b.get_object(Bucket="bkt", Key="video.mp4")["Body"].read()
        print(f"the object holds: {body.decode()!r}")
        b.release()
        ok = refusals == 2 and body == b"B's complete video"
    finally:
        gw.terminate()
        store.terminate()
        gw.wait(timeout=30)
        store.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    print("OK: the paused writer could not overwrite B's object" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
