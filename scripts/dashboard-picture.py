#!/usr/bin/env python3
"""Draws docs/stale-writes.png: what the dashboard's key panel shows while
the GC-pause story plays out against a real gateway and a real Prometheus.

It starts the fencegate binary and Prometheus on free loopback ports, plays
the story a number of times (writer A takes the lock, pauses past its TTL,
writer B takes over and writes, A comes back and writes with its old token),
then asks Prometheus's query API for the stale-writes panel's expression and
for fencegate_leases_active over the run, and plots both.

Usage: scripts/dashboard-picture.py [path/to/fencegate]   (needs matplotlib)
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "fencegate")
DASHBOARD = os.path.join(ROOT, "grafana", "dashboards", "fencegate.json")
OUT = os.path.join(ROOT, "docs", "stale-writes.png")
ROUNDS = 12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method, url, body=None, headers=None):
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_port(port, limit=30):
    deadline = time.time() + limit
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def main():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tmp = tempfile.mkdtemp(prefix="fencegate-picture-")
    proxy, api, prom = free_port(), free_port(), free_port()
    gw = subprocess.Popen([BINARY, "serve", "--data-dir", f"{tmp}/data", "--listen", f"127.0.0.1:{proxy}",
                           "--api-listen", f"127.0.0.1:{api}"], stderr=subprocess.DEVNULL)
    with open(f"{tmp}/prometheus.yml", "w") as f:
        f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: fencegate\n"
                f"    static_configs:\n      - targets: ['127.0.0.1:{api}']\n")
    pr = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml",
                           f"--web.listen-address=127.0.0.1:{prom}", f"--storage.tsdb.path={tmp}/tsdb"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(api)
        wait_port(prom)
        start = time.time()
        time.sleep(5)
        base = f"http://127.0.0.1:{api}/v1/locks"
        for i in range(ROUNDS):
            key = "invoices/42"
            _, a = call("POST", f"{base}/acquire", json.dumps({"key": key, "ttl_ms": 1000, "holder": "writer-a"}))
            ta = json.loads(a)["fencing_token"]
            call("PUT", f"http://127.0.0.1:{proxy}/{key}", "by A", {"X-Fencing-Token": str(ta)})
            time.sleep(1.5)  # A's GC pause: its lease expires
            _, b = call("POST", f"{base}/acquire", json.dumps({"key": key, "ttl_ms": 30000, "holder": "writer-b"}))
            b = json.loads(b)
            call("PUT", f"http://127.0.0.1:{proxy}/{key}", "by B", {"X-Fencing-Token": str(b["fencing_token"])})
            # A wakes up and retries its write a few times: refused each time.
            for _ in range(1 + i % 4):
                status, _ = call("PUT", f"http://127.0.0.1:{proxy}/{key}", "by A (zombie)",
                                 {"X-Fencing-Token": str(ta)})
                assert status == 409, status
            time.sleep(2)
            call("POST", f"{base}/release", json.dumps({"key": key, "lease_id": b["lease_id"]}))
            time.sleep(1)
        time.sleep(8)
        end = time.time()
        panel = next(p for p in json.load(open(DASHBOARD))["panels"] if p["title"].startswith("Stale writes"))
        expr = panel["targets"][0]["expr"].replace("$__rate_interval", "10s").replace("$route", ".*")

        def series(q):
            url = (f"http://127.0.0.1:{prom}/api/v1/query_range?query={urllib.parse.quote(q)}"
                   f"&start={start}&end={end}&step=1")
            _, text = call("GET", url)
            result = json.loads(text)["data"]["result"]
            if not result:
                return [], []
            pts = result[0]["values"]
            return [float(t) - start for t, _ in pts], [float(v) for _, v in pts]

        xs, ys = series(expr)
        lx, ly = series("sum(fencegate_leases_active)")
        fig, ax = plt.subplots(figsize=(10, 4.2), dpi=110)
        ax.fill_between(xs, ys, step="post", color="#d62728", alpha=0.35)
        ax.step(xs, ys, where="post", color="#d62728", label="stale writes refused / s (route default)")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("refused writes per second")
        ax2 = ax.twinx()
        ax2.step(lx, ly, where="post", color="#1f77b4", alpha=0.7, label="leases active")
        ax2.set_ylabel("leases active")
        ax2.set_ylim(0, 3)
        ax.set_title(f"fencegate dashboard, key panel: {ROUNDS} GC pauses, every zombie write stopped")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(OUT)
        print(f"wrote {OUT}: {len(xs)} points, peak {max(ys) if ys else 0:.2f}/s")
    finally:
        for p in (gw, pr):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
