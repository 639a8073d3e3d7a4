#!/usr/bin/env python3
"""One workload client of the nemesis harness's S3 mode (boto3 + the
fencegate Python client; run with the venv of ``scripts/setup-s3.sh``).

Loops until ``--stop-at`` (a ``time.monotonic()`` reading, one clock for
every process on the machine): acquire the lock of one of a few objects
(``nem/obj0``, ``nem/obj1``, ...; the lock key is the object's resource on
the gateway's S3 route, ``{bucket}/{key}``) with a short TTL, then hold it
for a "job" of 0.05-1.5 s of *GetObject through the gateway → think → one
fenced mutation derived from what was read → renew when half the TTL is
gone (or forget to)*, then release or let the lease run out. The token goes
on every request through ``fencegate.boto3_hook`` (signed: ``before-sign``).

The mutations, all through the gateway with the grant's token:

* ``put``     PutObject of the object read plus one line;
* ``mpu``     CreateMultipartUpload, UploadPart 1, a pause (the window in
              which the nemesis freezes a client mid-upload), UploadPart 2
              (a third of the uploads: part 1 is then padded to S3's 5 MiB
              minimum with a line of spaces, which readers skip),
              CompleteMultipartUpload — the same chain as a put;
* ``delete``  DeleteObject;
* ``delete-objects``  DeleteObjects naming the object (its key only in the
              XML body: the gateway fences it from the body).

An object's body is a chain of JSON lines, one per write that built it:
``{"id": "c3:17", "t": <token>, "op": "put"|"mpu", "prev": <id of the
last line read, or null>}``. A writer appends its line to exactly what it
read, so the final object names, in order, every write applied since the
last delete: the checker reads it from s3s-fs's directory, and every read
records the chain s3s-fs served (ids and tokens), so the checker also sees
the object's states between deletes.

Every operation is one JSON line in ``--record`` (flushed at once), with
``t0``/``t1`` the monotonic times it was sent and answered, ``st`` the HTTP
status (null when the exchange failed: then ``err``), ``code`` the S3 error
code of a refusal (``StaleFencingToken``, ...):

    {"ev":"acquire","c":"c3","key":"nem/obj1","t0":..,"t1":..,"st":200,"token":41,"ttl":600}
    {"ev":"read","c":"c3","key":"nem/obj1","token":41,"t0":..,"t1":..,"st":200,"last":"c1:17","lines":5,
     "chain":[["c2:3",39],...,["c1:17",40]]}
    {"ev":"put","c":"c3","key":"nem/obj1","token":41,"t0":..,"t1":..,"st":200,"id":"c3:9","prev":"c1:17"}
    {"ev":"mpu-create"|"mpu-part"|"mpu-complete"|"delete"|"delete-objects"|"renew"|"release"|"lost", ...}

The client judges its lease like a real one (a deadline started before the
acquire was sent, checked before each read, not before each write): a
process stopped between its read and its write, or between two parts of an
upload, wakes up and goes on with the token it holds — the GC-pause story.
"""
import argparse
import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "clients", "python"))

import boto3  # noqa: E402
import botocore.exceptions  # noqa: E402
from botocore.config import Config  # noqa: E402

import fencegate  # noqa: E402  (the repository's Python client: its boto3 hook)

mono = time.monotonic
STOP = False
BUCKET = "nem"
MIN_PART = 5 * 1024 * 1024  # S3's smallest part but the last


class Rec:
    def __init__(self, path, cid):
        self.f = open(path, "a", buffering=1)
        self.c = cid

    def __call__(self, **kv):
        kv["c"] = self.c
        self.f.write(json.dumps(kv, separators=(",", ":")) + "\n")


def api_call(api, path, body, timeout):
    """(status, JSON body) of a lease API call; (None, error text) when the
    exchange failed."""
    req = urllib.request.Request(api + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError) as e:
        return None, {"err": str(e)[:200]}


def outcome(fn):
    """Runs one boto3 call: (status, code, error text, response)."""
    try:
        r = fn()
        return r.get("ResponseMetadata", {}).get("HTTPStatusCode", 200), None, None, r
    except botocore.exceptions.ClientError as e:
        resp = e.response or {}
        return (resp.get("ResponseMetadata", {}).get("HTTPStatusCode"), resp.get("Error", {}).get("Code"),
                None, resp)
    except (botocore.exceptions.BotoCoreError, OSError, ValueError) as e:
        return None, None, f"{type(e).__name__}: {str(e)[:200]}", None


def parse_chain(body):
    """The chain of lines of an object body; None if it is not one."""
    lines = []
    for raw in body.splitlines():
        if not raw.strip():
            continue  # a padding line (multipart) or an empty one
        try:
            lines.append(json.loads(raw))
        except ValueError:
            return None
    return lines


class Worker:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.rec = Rec(a.record, a.id)
        self.n = 0
        self.token = None  # what the boto3 hook puts on every request
        cfg = Config(signature_version="s3v4", s3={"addressing_style": "path"},
                     retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2, read_timeout=8,
                     tcp_keepalive=True,
                     # s3s-fs 0.14.1 keeps an object's stored checksum across a
                     # later multipart Complete or delete + put of the key, and
                     # answers GET with it: botocore's default validation then
                     # fails reads of good objects. The checker validates the
                     # bodies itself (every line must parse).
                     response_checksum_validation="when_required",
                     request_checksum_calculation="when_required")
        self.s3 = boto3.session.Session().client(
            "s3", endpoint_url=a.proxy, aws_access_key_id=a.access_key, aws_secret_access_key=a.secret_key,
            region_name="us-east-1", config=cfg)
        fencegate.boto3_hook(self.s3, lambda: self.token)

    def next_id(self):
        self.n += 1
        return f"{self.a.id}:{self.n}"

    def acquire(self, key, ttl, wait):
        t0 = mono()
        st, body = api_call(self.a.api, "/v1/locks/acquire",
                            {"key": key, "ttl_ms": ttl, "wait_ms": wait, "holder": self.a.id}, wait / 1000 + 5)
        t1 = mono()
        token = body.get("fencing_token") if st == 200 else None
        self.rec(ev="acquire", key=key, t0=t0, t1=t1, st=st, token=token, ttl=ttl, wait=wait,
                 code=body.get("error"))
        return (token, body.get("lease_id"), t0) if token else (None, None, t0)

    def read(self, key, token):
        t0 = mono()
        st, code, err, r = outcome(lambda: self.s3.get_object(Bucket=BUCKET, Key=key.split("/", 1)[1]))
        chain, raw = None, b""
        if st == 200 and r is not None:
            try:
                raw = r["Body"].read()
            except (botocore.exceptions.BotoCoreError, OSError) as e:
                st, err = None, f"reading the body: {e}"
            chain = parse_chain(raw.decode("utf-8", "replace")) if st == 200 else None
            # What a write appends to: the chain without padding lines.
            raw = b"".join(line + b"\n" for line in raw.splitlines() if line.strip())
            if st == 200 and chain is None:
                err = "not a chain"
        elif st == 404:
            chain, raw = [], b""
        t1 = mono()
        self.rec(ev="read", key=key, token=token, t0=t0, t1=t1, st=st, code=code, err=err,
                 last=(chain[-1].get("id") if chain else None) if chain is not None else None,
                 lines=len(chain) if chain is not None else None,
                 chain=[[x.get("id"), x.get("t")] for x in chain] if chain else None)
        return (raw, chain) if chain is not None and st in (200, 404) else (None, None)

    def mutate(self, ev, key, token, fn, **extra):
        t0 = mono()
        st, code, err, r = outcome(fn)
        self.rec(ev=ev, key=key, token=token, t0=t0, t1=mono(), st=st, code=code, err=err, **extra)
        return st, r

    def write(self, key, token, raw, chain):
        obj = key.split("/", 1)[1]
        op = self.rng.choices(["put", "mpu", "delete", "delete-objects"], weights=[60, 26, 7, 7])[0]
        prev = chain[-1].get("id") if chain else None
        if op in ("delete", "delete-objects"):
            wid = self.next_id()
            if op == "delete":
                self.mutate("delete", key, token, lambda: self.s3.delete_object(Bucket=BUCKET, Key=obj), id=wid)
            else:
                def dos():
                    r = self.s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": obj}], "Quiet": False})
                    errs = r.get("Errors") or []
                    if errs:  # per-key failures inside a 200
                        raise botocore.exceptions.ClientError(
                            {"Error": {"Code": errs[0].get("Code")},
                             "ResponseMetadata": {"HTTPStatusCode": 500}}, "DeleteObjects")
                    return r
                self.mutate("delete-objects", key, token, dos, id=wid)
            return
        wid = self.next_id()
        line = json.dumps({"id": wid, "t": token, "op": op, "prev": prev}, separators=(",", ":")).encode() + b"\n"
        body = raw + line
        if op == "put":
            self.mutate("put", key, token, lambda: self.s3.put_object(Bucket=BUCKET, Key=obj, Body=body),
                        id=wid, prev=prev)
            return
        st, r = self.mutate("mpu-create", key, token,
                            lambda: self.s3.create_multipart_upload(Bucket=BUCKET, Key=obj), id=wid)
        if st != 200 or r is None:
            return
        upload = r["UploadId"]
        # One part, or (a third of the uploads) two: then every part but the
        # last must be at least 5 MiB (s3s-fs, like S3, refuses smaller ones
        # at Complete), so part 1 is the chain read plus a padding line of
        # spaces (readers skip it), part 2 the new line.
        if self.rng.random() < 1 / 3:
            pad = max(0, MIN_PART - len(raw) - 1)
            chunks = [raw + b" " * pad + b"\n", line]
        else:
            chunks = [body]
        parts = []
        for number, chunk in enumerate(chunks, 1):
            st, r = self.mutate("mpu-part", key, token,
                                lambda: self.s3.upload_part(Bucket=BUCKET, Key=obj, UploadId=upload,
                                                            PartNumber=number, Body=chunk),
                                id=wid, part=number)
            if st != 200 or r is None:
                return
            parts.append({"PartNumber": number, "ETag": r["ETag"]})
            if number == 1:
                time.sleep(self.rng.uniform(0.02, 0.2))  # mid-upload: the nemesis may freeze us here
        self.mutate("mpu-complete", key, token,
                    lambda: self.s3.complete_multipart_upload(Bucket=BUCKET, Key=obj, UploadId=upload,
                                                              MultipartUpload={"Parts": parts}),
                    id=wid, prev=prev)

    def job(self):
        a = self.a
        key = f"{BUCKET}/obj{self.rng.randrange(a.resources)}"
        ttl = self.rng.randint(a.ttl_min, a.ttl_max)
        wait = self.rng.choice([0, self.rng.randint(0, 2000)])
        token, lease_id, started = self.acquire(key, ttl, wait)
        if token is None:
            time.sleep(self.rng.uniform(0.02, 0.25))
            return
        deadline = started + ttl / 1000
        if wait:  # after a queue wait the deadline is far behind: renew at once
            deadline = self.renew(key, token, lease_id, ttl, deadline)
        self.token = token
        job_until = mono() + self.rng.uniform(0.05, 1.5)
        while not STOP and mono() < a.stop_at:
            if mono() >= deadline:
                self.rec(ev="lost", key=key, token=token, t0=mono(), t1=mono())
                break
            raw, chain = self.read(key, token)
            if chain is None:
                time.sleep(0.05)
                break
            time.sleep(self.rng.uniform(0.01, 0.12))  # think: the nemesis may freeze us here
            self.write(key, token, raw, chain)
            if mono() >= job_until:
                break
            if mono() > deadline - ttl / 2000 and self.rng.random() < 0.85:
                deadline = self.renew(key, token, lease_id, ttl, deadline)
        self.token = None
        if self.rng.random() < 0.75:
            t0 = mono()
            st, body = api_call(a.api, "/v1/locks/release", {"key": key, "lease_id": lease_id}, 5)
            self.rec(ev="release", key=key, token=token, t0=t0, t1=mono(), st=st, code=body.get("error"))

    def renew(self, key, token, lease_id, ttl, deadline):
        t0 = mono()
        st, body = api_call(self.a.api, "/v1/locks/renew", {"key": key, "lease_id": lease_id, "ttl_ms": ttl}, 5)
        self.rec(ev="renew", key=key, token=token, t0=t0, t1=mono(), st=st, code=body.get("error"))
        if st == 200:
            return t0 + body.get("ttl_ms", ttl) / 1000
        if st == 410:
            return 0.0  # lost: the next check ends the job
        return deadline

    def run(self):
        while not STOP and mono() < self.a.stop_at:
            self.job()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--id", required=True)
    ap.add_argument("--api", required=True)
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--resources", type=int, default=3)
    ap.add_argument("--ttl-min", type=int, default=300)
    ap.add_argument("--ttl-max", type=int, default=1000)
    ap.add_argument("--record", required=True)
    ap.add_argument("--stop-at", type=float, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--access-key", required=True)
    ap.add_argument("--secret-key", required=True)
    a = ap.parse_args()

    def on_term(signum, frame):
        global STOP
        STOP = True

    signal.signal(signal.SIGTERM, on_term)
    Worker(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
