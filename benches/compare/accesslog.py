#!/usr/bin/env python3
"""What the access log costs: the side-by-side harness's fenced PUT (1 KiB,
keep-alive, wrk with wrk/put.lua) at 32 connections through fencegate with
its access log on (`--log-level info`, stderr to a file) and off
(`--log-level warn`), and through nginx with `access_log … buffer=64k
flush=1s` on and `access_log off`, interleaved (A B C D A B C D …) in one
run. Reports requests/s per target and the on/off ratios of each
repetition and of the medians.

Placement as in run.sh: wrk and the backend (nginx `return 200`, no logs) on
BENCH_CPU_LOAD (default 0), the proxies on BENCH_CPU_SUT (default 1).
FENCEGATE_BIN picks the binary; FENCEGATE_BIN_BASE adds a second fencegate
(say, an older build) measured the same way. Every server listens on a free
127.0.0.1 port and is stopped by PID; every load is bounded in time.

    FENCEGATE_BIN=target/debug/fencegate python3 benches/compare/accesslog.py --reps 7 --secs 3
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_LOAD = os.environ.get("BENCH_CPU_LOAD", "0")
CPU_SUT = os.environ.get("BENCH_CPU_SUT", "1")


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_tcp(port, secs=30):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"accesslog: nothing listens on 127.0.0.1:{port} after {secs}s")


def post_json(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def tree(pid):
    """pid and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def cpu_ticks(pid):
    """User + system CPU ticks of a process tree (all threads)."""
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total


def wrk(conns, secs, url, token):
    env = dict(os.environ, FENCING_TOKEN=str(token))
    out = subprocess.run(
        ["taskset", "-c", CPU_LOAD, "wrk", "-t1", f"-c{conns}", f"-d{secs}s", "--timeout", "5s",
         "-s", os.path.join(HERE, "wrk", "put.lua"), url],
        env=env, capture_output=True, text=True, timeout=secs + 30, check=True).stdout
    line = [l for l in out.splitlines() if l.startswith("WRKJSON ")][-1]
    m = json.loads(line[len("WRKJSON "):])
    errs = sum(m[k] for k in m if k.startswith("err_"))
    if errs:
        raise SystemExit(f"accesslog: {errs} errors on {url}: {m}")
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--secs", type=int, default=3)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--out", help="figures as JSON")
    a = ap.parse_args()
    fg = os.environ.get("FENCEGATE_BIN")
    if not fg:
        raise SystemExit("accesslog: set FENCEGATE_BIN to the fencegate binary")
    base = os.environ.get("FENCEGATE_BIN_BASE")
    work = tempfile.mkdtemp(prefix="fg-accesslog-")
    procs = {}

    def start(name, cpu, argv, log):
        procs[name] = subprocess.Popen(["taskset", "-c", cpu] + argv, stdout=subprocess.DEVNULL,
                                       stderr=open(os.path.join(work, log), "wb"))

    try:
        p_backend, p_ngx_off, p_ngx_on, *p_fg = free_ports(11)
        tmpl = open(os.path.join(HERE, "conf", "nginx-backend.conf")).read()
        with open(os.path.join(work, "backend.conf"), "w") as f:
            f.write(tmpl.replace("@WORK@", work).replace("@PORT@", str(p_backend)))
        os.makedirs(os.path.join(work, "nginx-backend-body"))
        os.makedirs(os.path.join(work, "nginx-backend-proxy"))
        start("backend", CPU_LOAD, ["nginx", "-p", work, "-e", f"{work}/backend.err", "-c", f"{work}/backend.conf"],
              "backend.log")
        for name, port, log in (("nginx-off", p_ngx_off, "access_log off;"),
                                ("nginx-on", p_ngx_on, f"access_log {work}/{'nginx-on'}.access combined buffer=64k flush=1s;")):
            conf = f"""worker_processes 1; daemon off; master_process on; user root;
pid {work}/{name}.pid; error_log {work}/{name}.err warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
  {log}
  keepalive_requests 10000000; keepalive_timeout 300s;
  client_body_temp_path {work}/{name}-body; proxy_temp_path {work}/{name}-proxy;
  upstream backend {{ server 127.0.0.1:{p_backend}; keepalive 512; keepalive_requests 10000000; keepalive_timeout 300s; }}
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  proxy_set_header Host $http_host;
  proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
  proxy_set_header X-Forwarded-Proto $scheme;
  server {{ listen 127.0.0.1:{port} backlog=4096; location / {{ proxy_pass http://backend; }} }}
}}
"""
            with open(os.path.join(work, f"{name}.conf"), "w") as f:
                f.write(conf)
            os.makedirs(os.path.join(work, f"{name}-body"))
            os.makedirs(os.path.join(work, f"{name}-proxy"))
            start(name, CPU_SUT, ["nginx", "-p", work, "-e", f"{work}/{name}.err", "-c", f"{work}/{name}.conf"],
                  f"{name}.log")
        targets = {"nginx-off": p_ngx_off, "nginx-on": p_ngx_on}
        bins = [("fencegate", fg)] + ([("base", base)] if base else [])
        tokens = {}
        i = 0
        for label, binary in bins:
            for mode, level in (("on", "info"), ("off", "warn")):
                name = f"{label}-{mode}"
                proxy, api = p_fg[i], p_fg[i + 1]
                i += 2
                start(name, CPU_SUT, [binary, "serve", "--data-dir", f"{work}/{name}-data", "--listen",
                                      f"127.0.0.1:{proxy}", "--api-listen", f"127.0.0.1:{api}", "--upstream",
                                      f"http://127.0.0.1:{p_backend}", "--log-level", level], f"{name}.log")
                wait_tcp(api)
                wait_tcp(proxy)
                end = time.monotonic() + 30
                while True:
                    try:
                        tokens[name] = post_json(f"http://127.0.0.1:{api}/v1/locks/acquire",
                                                 {"key": "bench/obj", "ttl_ms": 3_600_000})["fencing_token"]
                        break
                    except OSError:
                        if time.monotonic() > end:
                            raise
                        time.sleep(0.1)
                targets[name] = proxy
        wait_tcp(p_backend)
        for p in (p_ngx_off, p_ngx_on):
            wait_tcp(p)
        order = list(targets)
        url = {t: f"http://127.0.0.1:{p}/bench/obj" for t, p in targets.items()}
        for t in order:  # warm-up
            wrk(a.conns, 1, url[t], tokens.get(t, 1))
        runs = {t: [] for t in order}
        for rep in range(a.reps):
            for t in order:
                c0 = cpu_ticks(procs[t].pid)
                m = wrk(a.conns, a.secs, url[t], tokens.get(t, 1))
                m["cpu_us_per_req"] = (cpu_ticks(procs[t].pid) - c0) / os.sysconf("SC_CLK_TCK") * 1e6 / m["requests"]
                runs[t].append(m)
                print(f"rep {rep + 1} {t}: {m['rps']:.0f} req/s p50 {m['p50_us']} us p99 {m['p99_us']} us, "
                      f"{m['cpu_us_per_req']:.1f} us CPU/request", file=sys.stderr)
        # The access log really was written: one line per request, once
        # the gateways with logs on have stopped (SIGTERM).
        for t in order:
            if t.endswith("-on") and not t.startswith("nginx"):
                os.kill(procs[t].pid, signal.SIGTERM)
                procs[t].wait(timeout=30)
        fg_lines = sum(1 for l in open(os.path.join(work, "fencegate-on.log"), errors="replace")
                       if "fencegate::access" in l and 'listener="proxy"' in l)
        fg_requests = sum(m["requests"] for m in runs["fencegate-on"])
        result = {"conns": a.conns, "secs": a.secs, "reps": a.reps, "targets": {}, "ratios": {}}
        for t in order:
            rps = [m["rps"] for m in runs[t]]
            cpu = [m["cpu_us_per_req"] for m in runs[t]]
            result["targets"][t] = {"rps": rps, "median_rps": statistics.median(rps),
                                    "p99_us": [m["p99_us"] for m in runs[t]],
                                    "cpu_us_per_req": cpu, "median_cpu_us_per_req": statistics.median(cpu)}
        print(f"\n{'target':<14} {'median req/s':>12} {'CPU us/req':>10}   req/s per repetition", file=sys.stderr)
        for t in order:
            r = result["targets"][t]
            print(f"{t:<14} {r['median_rps']:>12.0f} {r['median_cpu_us_per_req']:>10.1f}   "
                  f"{' '.join(f'{x:.0f}' for x in r['rps'])}", file=sys.stderr)
        for label in ["nginx", "fencegate"] + (["base"] if base else []):
            on, off = runs[f"{label}-on"], runs[f"{label}-off"]
            per = [x["rps"] / y["rps"] for x, y in zip(on, off)]
            med = result["targets"][f"{label}-on"]["median_rps"] / result["targets"][f"{label}-off"]["median_rps"]
            cpu_on = result["targets"][f"{label}-on"]["median_cpu_us_per_req"]
            cpu_off = result["targets"][f"{label}-off"]["median_cpu_us_per_req"]
            result["ratios"][label] = {"on_over_off_medians": med, "per_rep": per,
                                       "cpu_per_req_on_over_off": cpu_on / cpu_off}
            print(f"{label}: logs on / off = {med:.3f} req/s (cost {100 * (1 - med):.1f}%), per repetition "
                  f"{min(per):.3f}–{max(per):.3f}; CPU per request on / off = {cpu_on / cpu_off:.3f}",
                  file=sys.stderr)
        result["fencegate_access_lines"] = fg_lines
        result["fencegate_on_requests_at_least"] = fg_requests
        print(f"fencegate-on wrote {fg_lines} proxy access lines for ≥ {fg_requests} measured requests "
              f"(plus the warm-up)", file=sys.stderr)
        if fg_lines < fg_requests:
            raise SystemExit("accesslog: fencegate lost access lines")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(result["ratios"]))
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not os.environ.get("KEEP_WORK"):
            subprocess.run(["rm", "-rf", work], check=False)


if __name__ == "__main__":
    main()
