#!/usr/bin/env python3
"""Reproduction: activation does not survive a gateway restart.

A mutation the gateway forwarded just before it was ``kill -9``'d is still
being processed by the upstream; the restarted gateway knows nothing of it,
so the next grant's activation barrier does not wait for it, and the
upstream applies the older token's write *after* the newer token was
granted — although the configuration follows every rule of the README
(upstream request timeout 6 s < ``upstream_timeout_ms`` 10 s <
``activation_timeout_ms`` 15 s).

Steps (all on 127.0.0.1, free ports, standard library only):

1. recorder.py (applies writes, request timeout 6 s) and the gateway;
2. A acquires ``demo/1`` (TTL 500 ms) and gets token T1;
3. the recorder stalls for 3 s; A's PUT with T1 is forwarded into the stall;
4. the gateway is killed with SIGKILL and restarted on the same data dir;
5. B acquires ``demo/1`` (waiting in the queue): token T2 = T1 + 1 once
   A's restored lease ran out (~0.5 s after the restart);
6. the stall ends; the recorder applies A's T1 write, ~2 s after T2 was
   granted: the gateway's activation promise ("the grant's response waits
   until every in-flight mutation that carries an older token has
   finished", SPEC 1) did not hold.

Exit 1 if the anomaly reproduces, 0 if the write was not applied after T2's
grant (the gap is closed), 2 on a setup failure.

    python3 nemesis/repro_restart_gap.py [--binary target/debug/fencegate]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
mono = time.monotonic


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method, url, body=None, headers=None, timeout=30):
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


def wait_for(url, timeout=30):
    deadline = mono() + timeout
    while mono() < deadline:
        if call("GET", url, timeout=1)[0] == 200:
            return
        time.sleep(0.02)
    raise RuntimeError(f"{url} did not come up")


def main():
    ap = argparse.ArgumentParser(description="Reproduce the restart activation gap.")
    ap.add_argument("--binary", default=os.environ.get(
        "FENCEGATE_BIN", os.path.join(os.path.dirname(HERE), "target", "debug", "fencegate")))
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="fencegate-restart-gap-")
    rport, cport, pport, aport = free_port(), free_port(), free_port(), free_port()
    conf = os.path.join(d, "gateway.toml")
    with open(conf, "w") as f:
        f.write(f"""data_dir = "{d}/gw-data"
listen = "127.0.0.1:{pport}"
api_listen = "127.0.0.1:{aport}"
log_level = "warn"
[locks]
activation_timeout_ms = 15000
[[routes]]
match = "/{{*path}}"
upstream = "http://127.0.0.1:{rport}"
upstream_timeout_ms = 10000
""")
    procs = []

    def spawn(argv, name):
        p = subprocess.Popen(argv, stdout=open(os.path.join(d, name + ".log"), "ab"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    api, proxy, ctl = f"http://127.0.0.1:{aport}", f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{cport}"
    log_path = os.path.join(d, "recorder.jsonl")
    try:
        spawn([sys.executable, os.path.join(HERE, "recorder.py"), "--port", str(rport), "--control-port",
               str(cport), "--log", log_path, "--request-timeout", "6"], "recorder")
        wait_for(ctl + "/health")
        gw = spawn([args.binary, "serve", "--config", conf], "gateway")
        wait_for(api + "/readyz")

        st, body = call("POST", api + "/v1/locks/acquire", {"key": "demo/1", "ttl_ms": 500, "holder": "A"})
        t1 = json.loads(body)["fencing_token"]
        print(f"A holds demo/1 with token {t1} (TTL 500 ms)")
        call("POST", ctl + "/stall?seconds=3")
        stalled_at = mono()
        result = {}

        def a_writes():
            result["a"] = call("PUT", proxy + "/demo/1", b'{"by":"A"}', {"X-Fencing-Token": str(t1)})

        th = threading.Thread(target=a_writes, daemon=True)
        th.start()
        time.sleep(0.3)
        stats = json.loads(call("GET", ctl + "/stats")[1])
        print(f"upstream stalled for 3 s; A's PUT with token {t1} forwarded into it "
              f"(requests in flight at the upstream: {stats['inflight']})")
        gw.send_signal(signal.SIGKILL)
        gw.wait()
        print("gateway killed with SIGKILL; restarting it on the same data dir")
        gw = spawn([args.binary, "serve", "--config", conf], "gateway")
        wait_for(api + "/readyz")
        th.join(timeout=5)
        print(f"A's PUT answered: {result.get('a')}")
        st, body = call("POST", api + "/v1/locks/acquire",
                        {"key": "demo/1", "ttl_ms": 10000, "wait_ms": 5000, "holder": "B"})
        granted_at = mono()
        t2 = json.loads(body)["fencing_token"]
        print(f"B granted token {t2} at +{granted_at - stalled_at:.2f} s (the grant's answer is activation: "
              f"from here no write with token < {t2} may be applied)")
        time.sleep(max(0.0, stalled_at + 3.5 - mono()))
        applied = [json.loads(line) for line in open(log_path)]
        late = [r for r in applied if r["token"] == t1 and r["applied"] > granted_at]
        for r in applied:
            print(f"  upstream applied seq {r['seq']} token {r['token']} at +{r['applied'] - stalled_at:.2f} s")
        if late:
            print(f"REPRODUCED: the write with token {t1} was applied {late[0]['applied'] - granted_at:.2f} s "
                  f"after token {t2} had been granted")
            return 1
        print("not reproduced: no write with the older token was applied after the newer grant")
        return 0
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        print(f"setup failed: {e!r} (logs in {d})")
        return 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
