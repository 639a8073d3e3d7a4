#!/usr/bin/env python3
"""A legacy writer fenced by fencegate, with the standard library only.

Acquires a lock, renews it in a background thread, attaches the fencing
token to every write, and handles 409 (stale token: someone else holds the
lock now) by stopping. Writer 2 also numbers its writes (X-Fencing-Sequence),
so its own delayed retry of an older write is refused (409 stale_sequence)
instead of overwriting a newer one. Runs against a gateway it starts itself: set
FENCEGATE_BIN to the fencegate binary (default: target/debug/fencegate).

    python3 examples/python/legacy_writer.py
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method, url, body=None, token=None, sequence=None):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["X-Fencing-Token"] = str(token)
    if sequence is not None:
        headers["X-Fencing-Sequence"] = str(sequence)
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Lease:
    """A lease renewed every ttl/3 by a thread; `lost` is set when a renewal
    is refused or the local deadline (started before acquire) passes."""

    def __init__(self, api, key, ttl_ms, holder):
        self.api, self.key, self.ttl = api, key, ttl_ms / 1000
        started = time.monotonic()
        status, text = call("POST", f"{api}/v1/locks/acquire", {"key": key, "ttl_ms": ttl_ms, "holder": holder})
        if status != 200:
            raise RuntimeError(f"acquire: {status} {text}")
        grant = json.loads(text)
        self.token, self.lease_id = grant["fencing_token"], grant["lease_id"]
        self.deadline = started + self.ttl
        self.lost = threading.Event()
        self.stop = threading.Event()
        threading.Thread(target=self._renew, daemon=True).start()

    def _renew(self):
        while not self.stop.wait(self.ttl / 3):
            sent = time.monotonic()
            try:
                status, _ = call("POST", f"{self.api}/v1/locks/renew", {"key": self.key, "lease_id": self.lease_id})
            except OSError:
                status = None
            if status == 200:
                self.deadline = sent + self.ttl
            elif status == 410 or time.monotonic() >= self.deadline:
                self.lost.set()
                return

    def release(self):
        self.stop.set()
        call("POST", f"{self.api}/v1/locks/release", {"key": self.key, "lease_id": self.lease_id})


def main():
    binary = os.environ.get("FENCEGATE_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "target", "debug", "fencegate"))
    data = tempfile.mkdtemp(prefix="fencegate-py-")
    proxy, api_port = free_port(), free_port()
    gw = subprocess.Popen([binary, "serve", "--data-dir", data, "--listen", f"127.0.0.1:{proxy}",
                           "--api-listen", f"127.0.0.1:{api_port}"], stderr=subprocess.DEVNULL)
    api, url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{proxy}/ledger/2026"
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", api_port), timeout=1).close()
                socket.create_connection(("127.0.0.1", proxy), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        old = Lease(api, "ledger/2026", 1000, "legacy-writer-1")
        status, _ = call("PUT", url, b"balance=10", token=old.token)
        print(f"writer 1 (token {old.token}) writes: HTTP {status}")
        old.stop.set()  # writer 1 freezes: no more renewals
        time.sleep(1.3)
        new = Lease(api, "ledger/2026", 5000, "legacy-writer-2")
        # Writer 2 numbers its writes: 1, then 2. Its write 1 is retried
        # late (a timed-out request sent again) after write 2 landed.
        status, _ = call("PUT", url, b"balance=15", token=new.token, sequence=1)
        print(f"writer 2 (token {new.token}) writes #1: HTTP {status}")
        status, _ = call("PUT", url, b"balance=20", token=new.token, sequence=2)
        print(f"writer 2 (token {new.token}) writes #2: HTTP {status}")
        retry, text = call("PUT", url, b"balance=15", token=new.token, sequence=1)
        print(f"writer 2's late retry of #1: HTTP {retry} {text}")
        status, text = call("PUT", url, b"balance=0", token=old.token)
        print(f"writer 1 wakes up and writes with token {old.token}: HTTP {status} {text}")
        if status == 409:
            print("writer 1 learns it lost the lock and stops.")
        _, body = call("GET", url)
        new.release()
        print(f"the ledger holds: {body}")
        ok = status == 409 and retry == 409 and body == "balance=20"
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        shutil.rmtree(data, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
