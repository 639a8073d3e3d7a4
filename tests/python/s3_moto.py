"""Browser PostObject and DeleteObjects through an S3 route to moto's
server (broad API coverage, no signature checks). Run by tests/s3_sdk.rs
with FG_PROXY, FG_API, S3_DIRECT."""
import os
import urllib.error
import urllib.request

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

import fencegate

PROXY, API, DIRECT = os.environ["FG_PROXY"], os.environ["FG_API"], os.environ["S3_DIRECT"]
CFG = Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1})


def client(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1", config=CFG)


def live_and_stale(resource):
    old = fencegate.Lease.acquire(API, resource, ttl_ms=60_000)
    old.release()
    return fencegate.Lease.acquire(API, resource, ttl_ms=60_000), old.token


direct = client(DIRECT)
state = {"token": None, "tokens": None}
s3 = client(PROXY)
fencegate.boto3_hook(s3, lambda: state["token"], tokens=lambda: state["tokens"])

bucket, _ = live_and_stale("web")
state["token"] = bucket.token
s3.create_bucket(Bucket="web")


def post_form(fields, filename, content):
    boundary = "----fencegate-test-boundary"
    parts = []
    for k, v in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode())
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                 f'Content-Type: application/octet-stream\r\n\r\n'.encode() + content + f"\r\n--{boundary}--\r\n".encode())
    req = urllib.request.Request(PROXY + "/web", data=b"".join(parts), method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# PostObject: the key comes from the form; the token from the
# x-ignore-fencing-token field (a browser form sets no headers).
photo, photo_stale = live_and_stale("web/photos/cat.jpg")
# A key with ${filename} is refused: AWS and moto replace it, s3s does not.
by_name = dict(direct.generate_presigned_post("web", "photos/${filename}")["fields"])
status, body = post_form({**by_name, "x-ignore-fencing-token": str(photo.token)}, "cat.jpg", b"by name")
assert status == 400 and b"${filename}" in body, (status, body)
post = direct.generate_presigned_post("web", "photos/cat.jpg")
fields = dict(post["fields"])
status, body = post_form({**fields, "x-ignore-fencing-token": str(photo.token)}, "cat.jpg", b"the holder's cat")
assert status in (200, 201, 204), (status, body)
assert direct.get_object(Bucket="web", Key="photos/cat.jpg")["Body"].read() == b"the holder's cat"
status, body = post_form({**fields, "x-ignore-fencing-token": str(photo_stale)}, "cat.jpg", b"zombie cat")
assert status == 409 and b"<Code>StaleFencingToken</Code>" in body, (status, body)
status, body = post_form(fields, "cat.jpg", b"tokenless cat")
assert status == 428, (status, body)
assert direct.get_object(Bucket="web", Key="photos/cat.jpg")["Body"].read() == b"the holder's cat"

# DeleteObjects: one stale key among five refuses the whole request.
leases = {}
for i in range(5):
    k = f"batch/{i} & more"
    g, stale = live_and_stale("web/" + k)
    leases[k] = (g, stale)
    state["token"], state["tokens"] = g.token, None
    s3.put_object(Bucket="web", Key=k, Body=k.encode())
state["token"] = None
batch = {"Objects": [{"Key": k} for k in leases]}
state["tokens"] = {"web/" + k: (s if i == 3 else g.token) for i, (k, (g, s)) in enumerate(leases.items())}
try:
    s3.delete_objects(Bucket="web", Delete=batch)
    raise AssertionError("a DeleteObjects with a stale key went through")
except ClientError as e:
    assert e.response["Error"]["Code"] == "StaleFencingToken", e.response
for k in leases:
    direct.head_object(Bucket="web", Key=k)
state["tokens"] = {"web/" + k: g.token for k, (g, s) in leases.items()}
r = s3.delete_objects(Bucket="web", Delete=batch)
assert len(r.get("Deleted", [])) == 5 and not r.get("Errors"), r
assert "Contents" not in direct.list_objects_v2(Bucket="web", Prefix="batch/")
print("ok: PostObject and DeleteObjects against moto")
