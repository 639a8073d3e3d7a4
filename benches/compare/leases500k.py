#!/usr/bin/env python3
"""Issue 18: N held leases on fencegate and on Redis: fill, restart, the 1:1:1 mix, mass expiry.

    python3 benches/compare/leases500k.py                 # N = 500,000
    python3 benches/compare/leases500k.py --smoke         # N = 5,000, well under a minute
    python3 benches/compare/leases500k.py --keys 100000 --out FILE.json

Fill: N distinct keys acquired and held on fencegate (POST /v1/locks/acquire),
and the same N locks on Redis (`appendonly yes`, `appendfsync always`) the
way a careful Redis user takes them: `SET lock:K <32-hex owner> PX ttl NX`
plus `INCR fence:K`. Memory per held lease = (VmRSS after - VmRSS before) / N
for each server, and Redis's `used_memory` delta / N.

Restart: with the N leases live, SIGTERM fencegate and start it again on the
same data dir (time until /readyz answers 200), then check a sample of leases
(still held, same token, expires_in_ms close to what is left of the TTL), and
that releasing a sampled key and acquiring it again gives a token above its
last one. The same again after kill -9.

The leases' TTL is 15 minutes (--ttl-ms), longer than the whole run, so the
N leases stay held without renewals (renewing 500K leases every 10 s means
50K renewals/s, more than this one-process Python client does). The sample is
renewed right before each restart, so its expires_in_ms is checked against
the full TTL.

Mix (LOADGEN_BIN, the harness's `loadgen held`): on fresh servers, N leases
acquired by 64 closed-loop clients, one renewal round over all of them
(fencegate: POST /v1/locks/batch of 1,000; Redis: 1,000 pipelined
compare-and-pexpire scripts), then acquire : renew : release at 1 : 1 : 1 for
--mix-secs, one request per operation, closed loop at --mix-clients; then
the same mix open loop at each of --mix-rates offered operations a second
(fixed per-client schedules, latency counted from when each operation was
due); fencegate, then Redis (`appendfsync always`, the acquire a Lua
`SET NX PX` + `INCR fence`).

Mass expiry: on a fresh fencegate in front of nginx `return 200`, N leases
acquired, then one batch renewal round gives each a TTL ending at the same
instant, while wrk sends the harness's fenced 1 KiB PUT (32 connections) in
1-second slices: p99 before vs the slices around the expiry; afterwards every
lease must have expired (fencegate_leases_active back to the PUTs' own lease).

Standard library only (plus wrk, nginx and the load generator). Starts fencegate ($FENCEGATE_BIN, default
target/debug/fencegate) and redis-server (installed with apt-get when
missing) on free 127.0.0.1 ports, each with a fresh directory; the servers on
one CPU and this client on the other (taskset) when there are two; every loop
is bounded; the whole run stops itself after --budget-s seconds (default 540);
every process it started is stopped by PID at the end. Exits non-zero when a
check fails. KEEP_WORK=1 keeps the scratch directory (logs, data).
"""
import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Budget(Exception):
    pass


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


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def ensure_redis():
    if shutil.which("redis-server"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("redis-server is missing (Debian: apt-get install redis-server)")
    log("installing redis-server (apt-get update, apt-get install)")
    made = False
    if not os.path.exists("/usr/sbin/policy-rc.d"):  # keep the package's own service from starting
        with open("/usr/sbin/policy-rc.d", "w") as f:
            f.write("#!/bin/sh\nexit 101\n")
        os.chmod("/usr/sbin/policy-rc.d", 0o755)
        made = True
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True, env=env,
                       stdout=subprocess.DEVNULL, timeout=300)
    finally:
        if made:
            os.remove("/usr/sbin/policy-rc.d")


class Procs:
    """Every process we start, stopped by PID at the end."""

    def __init__(self, work, cpu):
        self.work, self.cpu, self.live = work, cpu, {}

    def start(self, name, argv, env=None):
        if self.cpu is not None and shutil.which("taskset"):
            argv = ["taskset", "-c", str(self.cpu)] + argv  # taskset execs: the PID is the server's
        logf = open(os.path.join(self.work, f"{name}.log"), "ab")
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, **(env or {})))
        logf.close()
        self.live[name] = p
        return p

    def stop(self, name, sig=signal.SIGTERM, wait_s=30.0):
        p = self.live.pop(name, None)
        if p is None:
            return None
        t0 = time.monotonic()
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        return time.monotonic() - t0

    def stop_all(self):
        for name in list(self.live)[::-1]:
            self.stop(name, wait_s=15)


# ---------------------------------------------------------------- HTTP/1.1, pipelined, keep-alive

class Http:
    def __init__(self, port):
        self.port = port

    async def open(self):
        self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    def close(self):
        self.w.close()

    async def batch(self, reqs):
        """Sends the requests pipelined on this connection; returns [(status, body bytes)]."""
        self.w.write(b"".join(reqs))
        await self.w.drain()
        out = []
        for _ in reqs:
            head = await self.r.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            cl = None
            for h in lines[1:]:
                k, _, v = h.partition(b":")
                if k.strip().lower() == b"content-length":
                    cl = int(v)
            if cl is None:
                raise RuntimeError(f"response without content-length: {head!r}")
            out.append((status, await self.r.readexactly(cl)))
        return out


def post(path, obj):
    body = json.dumps(obj, separators=(",", ":")).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def get(path):
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


# (send time of the batch, time its last reply was read), set before on_reply is called
BATCH_TIMES = [0.0, 0.0]


def key_of(i):
    return f"l18/{i:07d}"


async def run_ops(port, items, make_req, on_reply, conns, depth, deadline):
    """items split over `conns` keep-alive connections, `depth` requests in flight on each."""
    errors = []

    async def worker(part):
        c = await Http(port).open()
        try:
            for j in range(0, len(part), depth):
                if time.monotonic() > deadline:
                    raise Budget("out of time")
                chunk = part[j:j + depth]
                t_send = time.monotonic()
                replies = await c.batch([make_req(x) for x in chunk])
                BATCH_TIMES[:] = [t_send, time.monotonic()]
                for x, (st, body) in zip(chunk, replies):
                    err = on_reply(x, st, body)
                    if err and len(errors) < 5:
                        errors.append(err)
                    elif err:
                        errors.append(None)
        finally:
            c.close()

    await asyncio.gather(*(worker(items[w::conns]) for w in range(conns)))
    return [e for e in errors if e], len(errors)


async def wait_ready(port, timeout_s):
    """Polls GET /readyz on a fresh connection every 5 ms; returns True once it answers 200."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            c = await asyncio.wait_for(Http(port).open(), 1)
            try:
                (st, _), = await asyncio.wait_for(c.batch([get("/readyz")]), 1)
            finally:
                c.close()
            if st == 200:
                return True
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, RuntimeError):
            pass
        await asyncio.sleep(0.005)
    return False


# ---------------------------------------------------------------- RESP, pipelined

def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


async def resp_read(r):
    line = await r.readuntil(b"\r\n")
    t, rest = line[:1], line[1:-2]
    if t in (b"+", b":"):
        return rest
    if t == b"-":
        return RuntimeError(rest.decode())
    if t == b"$":
        n = int(rest)
        return None if n < 0 else (await r.readexactly(n + 2))[:-2]
    if t == b"*":
        return [await resp_read(r) for _ in range(int(rest))]
    raise RuntimeError(f"bad RESP {line!r}")


async def redis_cmd(port, *args):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(resp(*args))
    await w.drain()
    v = await resp_read(r)
    w.close()
    return v


async def redis_info_memory(port):
    txt = (await redis_cmd(port, "INFO", "memory")).decode()
    return int(re.search(r"^used_memory:(\d+)", txt, re.M).group(1))


async def redis_fill(port, n, ttl_ms, conns, batch, deadline, prefix=""):
    bad = []

    async def worker(idx):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            for j in range(0, len(idx), batch):
                if time.monotonic() > deadline:
                    raise Budget("out of time")
                chunk = idx[j:j + batch]
                buf = []
                for i in chunk:
                    k = f"{prefix}{key_of(i)}"
                    buf.append(resp("SET", f"lock:{k}", "%032x" % random.getrandbits(128), "PX", ttl_ms, "NX"))
                    buf.append(resp("INCR", f"fence:{k}"))
                w.write(b"".join(buf))
                await w.drain()
                for _ in chunk:
                    a, b = await resp_read(r), await resp_read(r)
                    if a != b"OK" or not isinstance(b, bytes):
                        bad.append((a, b))
        finally:
            w.close()

    ids = list(range(n))
    await asyncio.gather(*(worker(ids[w::conns]) for w in range(conns)))
    return bad


# ---------------------------------------------------------------- the 1:1:1 mix (loadgen held)

def loadgen_bin():
    lg = os.environ.get("LOADGEN_BIN")
    if not lg or not os.access(lg, os.X_OK):
        raise RuntimeError("LOADGEN_BIN must name the harness's load generator (benches/compare/loadgen, "
                           "built by run.sh: cargo build --release in benches/compare/loadgen)")
    return lg


async def mix_phase(a, procs, work, fg_bin, deadline, problems):
    """N leases held, a renewal round over all of them, then the 1:1:1 mix at 64 clients, closed
    loop: fencegate and Redis (appendfsync always) in turn, each on fresh servers, the same
    load generator (loadgen held)."""
    lg = loadgen_bin()
    rates = [int(r) for r in a.mix_rates.split(",") if r]
    out = {}
    for system in ("fencegate", "redis"):
        p_fg, p_api, p_redis = free_ports(3)
        d = os.path.join(work, f"mix-{system}")
        os.makedirs(d)
        if system == "fencegate":
            procs.start("mix-fencegate", [fg_bin, "serve", "--data-dir", os.path.join(d, "data"), "--listen",
                                          f"127.0.0.1:{p_fg}", "--api-listen", f"127.0.0.1:{p_api}"],
                        {"RUST_LOG": "warn"})
            if not await wait_ready(p_api, 30):
                raise RuntimeError("mix: fencegate not ready after 30 s")
            addr = f"127.0.0.1:{p_api}"
        else:
            procs.start("mix-redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(p_redis), "--dir", d,
                                      "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                                      "--daemonize", "no", "--protected-mode", "no", "--logfile", ""])
            for _ in range(600):
                try:
                    if await redis_cmd(p_redis, "PING") == b"PONG":
                        break
                except OSError:
                    await asyncio.sleep(0.05)
            addr = f"127.0.0.1:{p_redis}"
        left = deadline - time.monotonic()
        if left < 10:
            raise Budget("out of time before the mix")
        argv = [lg, "held", system, addr, "--keys", str(a.keys), "--clients", str(a.mix_clients),
                "--secs", str(a.mix_secs), "--batch", "1000", "--ttl-ms", str(a.ttl_ms),
                "--rates", ",".join(str(r) for r in rates)]
        if shutil.which("taskset"):
            argv = ["taskset", "-c", "0"] + argv
        r = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=left)
        procs.stop(f"mix-{system}")
        if r.returncode != 0:
            problems.append(f"mix {system}: loadgen failed: {r.stderr.strip()[-300:]}")
            continue
        v = json.loads(r.stdout.strip().splitlines()[-1])
        out[system] = v
        m = v["mix"]
        if m["errors"]:
            problems.append(f"mix {system}: {m['errors']} errors, first: {m['first_error']}")
        if v["renew_round"]["failed"]:
            problems.append(f"mix {system}: {v['renew_round']['failed']} renewals of the round failed")
        log(f"mix {system}: fill {v['fill']['per_s']:,.0f}/s; renewal round of {a.keys:,} in "
            f"{v['renew_round']['secs']:.2f} s ({v['renew_round']['per_s']:,.0f}/s); 1:1:1 mix "
            f"{m['ops_per_s']:,.0f} ops/s, p50 {m['p50_us']} us, p99 {m['p99_us']} us "
            f"(acquire p99 {m['acquire']['p99_us']}, renew p99 {m['renew']['p99_us']}, "
            f"release p99 {m['release']['p99_us']} us), {v['held_after']:,} held after")
        for o in v["open_loop"]:
            if o["errors"]:
                problems.append(f"open-loop mix {system} at {o['offered_per_s']}/s: {o['errors']} errors, "
                                f"first: {o['first_error']}")
            log(f"open-loop mix {system}: offered {o['offered_per_s']:,.0f} ops/s, answered "
                f"{o['ops_per_s']:,.0f}/s, p50 {o['p50_us']} us, p99 {o['p99_us']} us (from when each was due; "
                f"{o['sent_more_than_one_interval_late']} sent more than one interval late)")
    if "fencegate" in out and "redis" in out:
        f, r = out["fencegate"], out["redis"]
        out["ratios"] = {
            "mix_ops_per_s": round(f["mix"]["ops_per_s"] / r["mix"]["ops_per_s"], 2),
            "mix_p50": round(f["mix"]["p50_us"] / max(r["mix"]["p50_us"], 1), 2),
            "mix_p99": round(f["mix"]["p99_us"] / max(r["mix"]["p99_us"], 1), 2),
            "fill_per_s": round(f["fill"]["per_s"] / r["fill"]["per_s"], 2),
            "renew_round_per_s": round(f["renew_round"]["per_s"] / r["renew_round"]["per_s"], 2),
        }
        for fo, ro in zip(f["open_loop"], r["open_loop"]):
            out["ratios"][f"open_{int(fo['offered_per_s'])}"] = {
                "answered_per_s": round(fo["ops_per_s"] / max(ro["ops_per_s"], 1), 2),
                "p50": round(fo["p50_us"] / max(ro["p50_us"], 1), 2),
                "p99": round(fo["p99_us"] / max(ro["p99_us"], 1), 2),
            }
        log(f"mix fencegate / Redis: {out['ratios']}")
    return out


# ---------------------------------------------------------------- mass expiry under fenced PUTs

def wrk_slice(url, token, secs=1, conns=32):
    """One wrk run of the harness's fenced 1 KiB PUT; its WRKJSON line."""
    argv = ["wrk", "-t1", f"-c{conns}", f"-d{secs}s", "--timeout", "5s", "-s",
            os.path.join(HERE, "wrk", "put.lua"), url]
    if shutil.which("taskset"):
        argv = ["taskset", "-c", "0"] + argv
    r = subprocess.run(argv, capture_output=True, text=True, timeout=secs + 30,
                       env=dict(os.environ, FENCING_TOKEN=str(token), WRK_QUANTILES="1"))
    for line in r.stdout.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[len("WRKJSON "):])
    raise RuntimeError(f"wrk gave no result: {r.stdout[-300:]} {r.stderr[-300:]}")


def pooled_p99(runs):
    """The p99 of several wrk runs taken together: each run's latency distribution (its quantile
    table "q", a step function) weighted by its request count; the smallest latency at which the
    pooled distribution reaches 99 %. None when a run has no table."""
    if not runs or any("q" not in r for r in runs):
        return None
    total = sum(r["requests"] for r in runs)
    if total == 0:
        return None

    def cdf(run, x):
        below = [p for p, v in run["q"] if v <= x]
        return (max(below) if below else 0.0) / 100.0

    for x in sorted({v for r in runs for _, v in r["q"]}):
        if sum(r["requests"] * cdf(r, x) for r in runs) >= 0.99 * total:
            return x
    return max(v for r in runs for _, v in r["q"])


async def expiry_phase(a, procs, work, fg_bin, deadline, problems, control=False):
    """N leases made to expire within the same second (a batch renewal round sets each one's TTL to
    end at the same instant) while wrk sends fenced PUTs through the proxy to nginx `return 200`:
    the PUTs' p99 in 1-second slices before, during and after the expiry.

    control: the same steps, but the renewal round gives every lease 10 minutes more, so nothing
    expires in the window: what the figure reads on this machine when there is no mass expiry (the
    worst of the slices around "the instant" over the median of the slices before)."""
    if not shutil.which("wrk") or not shutil.which("nginx"):
        raise RuntimeError("the mass-expiry part needs wrk and nginx (run.sh installs them)")
    p_backend, p_fg, p_api = free_ports(3)
    tag = "expiry-control" if control else "expiry"
    d = os.path.join(work, tag)
    os.makedirs(os.path.join(d, "nginx-backend-body"))
    os.makedirs(os.path.join(d, "nginx-backend-proxy"))
    with open(os.path.join(HERE, "conf", "nginx-backend.conf")) as f:
        conf = f.read().replace("@WORK@", d).replace("@PORT@", str(p_backend))
    with open(os.path.join(d, "backend.conf"), "w") as f:
        f.write(conf)
    backend = procs.start(f"{tag}-backend", ["nginx", "-p", d, "-e", os.path.join(d, "backend.err"),
                                             "-c", os.path.join(d, "backend.conf")])
    procs.start(f"{tag}-fencegate", [fg_bin, "serve", "--data-dir", os.path.join(d, "data"), "--listen",
                                     f"127.0.0.1:{p_fg}", "--api-listen", f"127.0.0.1:{p_api}", "--upstream",
                                     f"http://127.0.0.1:{p_backend}"], {"RUST_LOG": "warn"})
    if not await wait_ready(p_api, 30):
        raise RuntimeError("expiry: fencegate not ready after 30 s")
    if backend.poll() is not None:
        raise RuntimeError(f"expiry: the nginx backend exited (see {tag}-backend.log)")
    n = a.keys
    # The token of the PUTs: a lease on the object written, held throughout.
    got = {}
    await run_ops(p_api, [0], lambda i: post("/v1/locks/acquire", {"key": "bench/obj", "ttl_ms": 3_600_000}),
                  lambda i, st, b: got.__setitem__("t", json.loads(b)["fencing_token"]) if st == 200 else f"{st}",
                  1, 1, deadline)
    if "t" not in got:
        raise RuntimeError("expiry: no token for the PUTs")
    token = got["t"]
    url = f"http://127.0.0.1:{p_fg}/bench/obj"
    # N leases, then one batch renewal round that sets every lease's TTL to end at `expire_at`.
    leases = [None] * n

    def on_acq(i, st, body):
        if st != 200:
            return f"acquire {st}"
        leases[i] = json.loads(body)["lease_id"]
    errs, nerr = await run_ops(p_api, list(range(n)),
                               lambda i: post("/v1/locks/acquire", {"key": f"x/{key_of(i)}", "ttl_ms": a.ttl_ms}),
                               on_acq, a.conns, a.depth, deadline)
    if nerr:
        raise RuntimeError(f"expiry: fill: {nerr} errors, first {errs[:2]}")
    await asyncio.to_thread(wrk_slice, url, token)  # warm-up
    baseline = [await asyncio.to_thread(wrk_slice, url, token) for _ in range(a.expiry_slices)]
    # The renewal round (batches of 1,000 over 16 connections) should take well under `lead_s`.
    lead_s = 4.0 if a.smoke else 12.0
    expire_at = time.monotonic() + lead_s
    late = []

    extra_ms = 600_000 if control else 0

    def renew_batch(chunk):
        ttl = int((expire_at - time.monotonic()) * 1000) + extra_ms
        ops = [{"op": "renew", "key": f"x/{key_of(i)}", "lease_id": leases[i], "ttl_ms": max(ttl, 100)}
               for i in chunk]
        return post("/v1/locks/batch", {"operations": ops})

    def on_batch(chunk, st, body):
        if st != 200:
            return f"batch {st} {body[:200]!r}"
        bad = [r for r in json.loads(body)["results"] if r["status"] != 200]
        return f"{len(bad)} renewals refused: {bad[:1]}" if bad else None
    chunks = [list(range(j, min(j + 1000, n))) for j in range(0, n, 1000)]
    t0 = time.monotonic()
    errs, nerr = await run_ops(p_api, chunks, renew_batch, on_batch, 16, 1, deadline)
    round_s = time.monotonic() - t0
    if nerr:
        problems.append(f"expiry: renewal round: {nerr} errors, first {errs[:2]}")
    if time.monotonic() > expire_at - 1:
        late.append(f"the renewal round took {round_s:.1f} s, too close to the expiry")
    # Fenced PUTs in 1-second slices until --expiry-after-s after the expiry, and on while the sweep
    # lasts (up to 30 s after the instant): every slice of the sweep counts.
    want = n + 1 if control else 1
    stats = {}
    metric = lambda name: next((float(l.split()[-1]) for l in stats.get("m", "").splitlines()
                                if l.startswith(name + " ")), None)

    async def read_metrics():
        await run_ops(p_api, [0], lambda i: get("/metrics"),
                      lambda i, st, b: stats.__setitem__("m", b.decode(errors="replace")), 1, 1, deadline)

    slices = []
    while time.monotonic() < deadline:
        since = time.monotonic() - expire_at
        if since >= a.expiry_after_s:
            if since >= 30:
                break
            await read_metrics()
            if metric("fencegate_leases_active") == want:
                break
        t_s = time.monotonic() - expire_at
        m = await asyncio.to_thread(wrk_slice, url, token)
        m["start_rel_s"] = round(t_s, 2)
        if m["requests"] == 0:
            # Not one PUT answered in the whole slice: the gateway stalled
            # for at least its length.
            m["p99_us"] = m["p50_us"] = int(m["duration_us"])
            m["stalled"] = True
        slices.append(m)
    # The sweep (ending each expired grant, writing its record) is paced
    # behind the deadlines (an expired lease is refused at its deadline,
    # swept or not): wait up to 30 s for it to finish, and say when it did.
    swept_after_s = None  # control: when the metric was read as expected
    for i in range(61):
        if i:
            await asyncio.sleep(0.5)
        await read_metrics()
        if metric("fencegate_leases_active") == want:
            swept_after_s = round(time.monotonic() - expire_at, 1)
            break
    procs.stop(f"{tag}-fencegate")
    procs.stop(f"{tag}-backend")
    # Every slice from the one before the instant to the end: working off
    # N expirations takes seconds, and all of them count.
    during = [s for s in slices if s["start_rel_s"] > -1.0]
    errors = sum(s[k] for s in baseline + slices for k in s if k.startswith("err_"))
    base_p99 = statistics.median(s["p99_us"] for s in baseline)
    out = {"leases": n, "renewal_round_s": round(round_s, 2),
           "baseline": [{k: s[k] for k in ("rps", "p50_us", "p99_us")} for s in baseline],
           "slices": [{k: s[k] for k in ("start_rel_s", "rps", "p50_us", "p99_us", "max_us")} | {"stalled": s.get("stalled", False)}
                      for s in slices],
           "baseline_p99_us": base_p99,
           "during_p99_us": max((s["p99_us"] for s in during), default=None),
           "during_median_p99_us": statistics.median(s["p99_us"] for s in during) if during else None,
           "leases_active_after": metric("fencegate_leases_active"),
           "swept_after_s": swept_after_s,
           "expirations_total": metric("fencegate_lease_expirations_total"),
           "wrk_errors": errors, "problems": late}
    if out["during_p99_us"] is not None:
        out["p99_during_over_before"] = round(out["during_p99_us"] / max(base_p99, 1), 2)
    # The same question asked of every PUT at once: the p99 of all the PUTs of the window (from the
    # slice before the instant to the end) over the p99 of all the PUTs before — less at the mercy of
    # one noisy second than the worst slice.
    pooled_before, pooled_during = pooled_p99(baseline), pooled_p99(during)
    out["pooled_p99_before_us"], out["pooled_p99_during_us"] = pooled_before, pooled_during
    if pooled_before and pooled_during:
        out["pooled_p99_during_over_before"] = round(pooled_during / pooled_before, 2)
    problems.extend(f"expiry: {x}" for x in late)
    if errors:
        problems.append(f"expiry: {errors} wrk errors")
    if any(s.get("stalled") for s in slices):
        problems.append("expiry: a 1-s slice of fenced PUTs got no answer at all (the gateway stalled)")
    if control:
        out["control"] = True
        if out["leases_active_after"] != n + 1 or out["expirations_total"]:
            problems.append(f"expiry control: leases_active = {out['leases_active_after']}, expirations = "
                            f"{out['expirations_total']} (expected {n + 1} and 0: nothing was due)")
    elif out["leases_active_after"] != 1 or (out["expirations_total"] or 0) < n:
        problems.append(f"expiry: after the expiry leases_active = {out['leases_active_after']}, "
                        f"expirations = {out['expirations_total']} (expected 1 and {n})")
    log(f"{'control (no expiry) with' if control else 'mass expiry of'} {n:,} leases: renewal round {round_s:.1f} s; fenced PUT p99 before "
        f"{base_p99} us (median of {len(baseline)} 1-s slices), during {out['during_p99_us']} us "
        f"({out.get('p99_during_over_before')}x; median slice {out['during_median_p99_us']} us; every PUT of the "
        f"window pooled: {out.get('pooled_p99_during_us')} us over {out.get('pooled_p99_before_us')} us, "
        f"{out.get('pooled_p99_during_over_before')}x); slices {[(s['start_rel_s'], s['p99_us']) for s in slices]}; "
        f"after: leases_active {out['leases_active_after']}, expirations {out['expirations_total']}"
        + ("" if control else f", swept by {out['swept_after_s']} s after the instant"))
    return out


# ---------------------------------------------------------------- the run

async def main_async(a, procs, work, fg_bin, deadline):
    res = {"keys": a.keys, "ttl_ms": a.ttl_ms, "sample": a.sample}
    problems = []
    p_fg, p_api, p_redis = free_ports(3)
    fg_dir = os.path.join(work, "fg-data")
    redis_dir = os.path.join(work, "redis")
    os.makedirs(redis_dir)
    fg_argv = [fg_bin, "serve", "--data-dir", fg_dir, "--listen", f"127.0.0.1:{p_fg}",
               "--api-listen", f"127.0.0.1:{p_api}"]
    fg_env = {"RUST_LOG": "warn,fencegate::app=info"}  # keeps the "fence table rebuilt" line
    procs.start("fencegate", fg_argv, fg_env)
    procs.start("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(p_redis), "--dir", redis_dir,
                          "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                          "--daemonize", "no", "--protected-mode", "no", "--logfile", ""])
    if not await wait_ready(p_api, 30):
        raise RuntimeError("fencegate not ready after 30 s")
    for _ in range(600):
        try:
            if await redis_cmd(p_redis, "PING") == b"PONG":
                break
        except OSError:
            await asyncio.sleep(0.05)
    else:
        raise RuntimeError("redis not answering after 30 s")
    res["versions"] = {
        "redis": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip(),
    }

    # Warm-up (not counted): 64 acquire + release on other keys, 64 SET/INCR/DEL on Redis.
    def warm_acq(i):
        return post("/v1/locks/acquire", {"key": f"warm/{i}", "ttl_ms": 1000})
    leases_w = {}
    await run_ops(p_api, list(range(64)), warm_acq,
                  lambda i, st, b: leases_w.__setitem__(i, json.loads(b)["lease_id"]) if st == 200 else f"warm {st}",
                  8, 8, deadline)
    await run_ops(p_api, list(range(64)),
                  lambda i: post("/v1/locks/release", {"key": f"warm/{i}", "lease_id": leases_w[i]}),
                  lambda i, st, b: None, 8, 8, deadline)
    await redis_fill(p_redis, 64, 1000, 4, 16, deadline, prefix="warm/")
    await redis_cmd(p_redis, "FLUSHALL")
    await asyncio.sleep(1.0)

    fg_pid, redis_pid = procs.live["fencegate"].pid, procs.live["redis"].pid
    n, ttl = a.keys, a.ttl_ms

    # ------------------------------------------------------------ Fill: fencegate
    tokens, lease_ids = [0] * n, [None] * n
    rss0 = rss_kib(fg_pid)

    def on_acq(i, st, body):
        if st != 200:
            return f"acquire {key_of(i)}: {st} {body[:200]!r}"
        v = json.loads(body)
        tokens[i], lease_ids[i] = v["fencing_token"], v["lease_id"]
        return None

    t0 = time.monotonic()
    errs, nerr = await run_ops(p_api, list(range(n)),
                               lambda i: post("/v1/locks/acquire", {"key": key_of(i), "ttl_ms": ttl}),
                               on_acq, a.conns, a.depth, deadline)
    fill_s = time.monotonic() - t0
    await asyncio.sleep(1.0)
    rss1 = rss_kib(fg_pid)
    if nerr:
        problems.append(f"fencegate fill: {nerr} errors, first: {errs[:2]}")
    res["fencegate_fill"] = {"secs": round(fill_s, 2), "per_s": round(n / fill_s), "errors": nerr,
                             "rss_before_kib": rss0, "rss_after_kib": rss1,
                             "bytes_per_lease": round((rss1 - rss0) * 1024 / n, 1)}
    log(f"fencegate: {n} leases acquired in {fill_s:.1f} s ({n / fill_s:,.0f}/s, {nerr} errors); "
        f"RSS {rss0} -> {rss1} KiB = {res['fencegate_fill']['bytes_per_lease']} B/lease")

    # ------------------------------------------------------------ Fill: Redis
    rrss0, um0 = rss_kib(redis_pid), await redis_info_memory(p_redis)
    t0 = time.monotonic()
    bad = await redis_fill(p_redis, n, ttl, a.redis_conns, a.redis_batch, deadline)
    rfill_s = time.monotonic() - t0
    await asyncio.sleep(1.0)
    rrss1, um1 = rss_kib(redis_pid), await redis_info_memory(p_redis)
    dbsize = int(await redis_cmd(p_redis, "DBSIZE"))
    if bad:
        problems.append(f"redis fill: {len(bad)} bad replies, first: {bad[:2]}")
    if dbsize != 2 * n:
        problems.append(f"redis DBSIZE {dbsize}, expected {2 * n}")
    res["redis_fill"] = {"secs": round(rfill_s, 2), "per_s": round(n / rfill_s), "errors": len(bad), "dbsize": dbsize,
                         "rss_before_kib": rrss0, "rss_after_kib": rrss1,
                         "used_memory_before": um0, "used_memory_after": um1,
                         "bytes_per_lock_rss": round((rrss1 - rrss0) * 1024 / n, 1),
                         "bytes_per_lock_used_memory": round((um1 - um0) / n, 1)}
    log(f"redis: {n} locks (SET NX PX + INCR) in {rfill_s:.1f} s; RSS {rrss0} -> {rrss1} KiB = "
        f"{res['redis_fill']['bytes_per_lock_rss']} B/lock; used_memory delta "
        f"{res['redis_fill']['bytes_per_lock_used_memory']} B/lock")
    fgb = res["fencegate_fill"]["bytes_per_lease"]
    res["ratio_rss"] = round(fgb / res["redis_fill"]["bytes_per_lock_rss"], 2)
    res["ratio_used_memory"] = round(fgb / res["redis_fill"]["bytes_per_lock_used_memory"], 2)
    log(f"memory per held lease, fencegate / Redis: {res['ratio_rss']}x (RSS), "
        f"{res['ratio_used_memory']}x (vs Redis used_memory)")
    procs.stop("redis")  # not needed for the restarts; frees its CPU

    # ------------------------------------------------------------ Restart
    rnd = random.Random(18)
    sample = rnd.sample(range(n), min(a.sample, n))
    renewed = {}  # i -> (renewal sent, its reply read), client clock

    async def renew_sample():
        def on_renew(i, st, body):
            if st != 200:
                return f"renew {key_of(i)}: {st} {body[:200]!r}"
            renewed[i] = tuple(BATCH_TIMES)
            return None
        errs, nerr = await run_ops(p_api, sample, lambda i: post("/v1/locks/renew", {"key": key_of(i), "lease_id": lease_ids[i]}),
                                   on_renew, min(a.conns, 32), a.depth, deadline)
        return nerr, errs

    async def check_sample(t_start, t_ready):
        stats = {"held_same_token": 0, "wrong": 0, "expires_in_ms": [], "bounds": [], "first_wrong": []}

        def on_status(i, st, body):
            v = json.loads(body) if st == 200 else {}
            if st == 200 and v.get("held") and v.get("fencing_token") == tokens[i]:
                stats["held_same_token"] += 1
                stats["expires_in_ms"].append(v["expires_in_ms"])
                # The TTL left since the last renewal, bounded with the client's clock: the server
                # renewed between (renewal sent, reply read) and answered the status between
                # (status sent, reply read).
                (rs, rr), (ss, sr) = renewed[i], BATCH_TIMES
                # fencegate documents that a grant live at a restart comes back with its full TTL
                # counted from the restart: between the process start and /readyz answering.
                stats["bounds"].append((ttl - (sr - rs) * 1000, ttl - (ss - rr) * 1000,
                                        ttl - (sr - t_start) * 1000, ttl - (ss - t_ready) * 1000))
            else:
                stats["wrong"] += 1
                if len(stats["first_wrong"]) < 3:
                    stats["first_wrong"].append((key_of(i), tokens[i], st, body[:200].decode(errors="replace")))
            return None
        await run_ops(p_api, sample, lambda i: get(f"/v1/locks/status?key={key_of(i)}"), on_status,
                      min(a.conns, 32), a.depth, deadline)
        e, b = stats.pop("expires_in_ms"), stats.pop("bounds")
        if e:
            stats["expires_in_ms"] = {"min": min(e), "median": statistics.median(e), "max": max(e)}
            # above the TTL left (> 0: the server holds the lease longer than its holder counts on)
            over = [ei - x[1] for ei, x in zip(e, b)]
            stats["over_ttl_left_since_renewal_ms"] = {"min": round(min(over)), "max": round(max(over))}
            # the documented rule: the full TTL counted from the restart (1 ms rounding either side)
            stats["full_ttl_from_restart"] = sum(1 for ei, x in zip(e, b) if x[2] - 1 <= ei <= x[3] + 1)
        return stats

    async def release_reacquire(keys):
        """Releases each key, acquires it again; counts next tokens above the last."""
        out = {"released": 0, "token_above": 0, "not_above": [], "errors": []}

        def on_rel(i, st, body):
            if st == 200 and json.loads(body).get("released"):
                out["released"] += 1
            elif len(out["errors"]) < 3:
                out["errors"].append((key_of(i), st, body[:200].decode(errors="replace")))
        await run_ops(p_api, keys, lambda i: post("/v1/locks/release", {"key": key_of(i), "lease_id": lease_ids[i]}),
                      on_rel, 16, 4, deadline)

        def on_acq2(i, st, body):
            if st != 200:
                if len(out["errors"]) < 3:
                    out["errors"].append((key_of(i), st, body[:200].decode(errors="replace")))
                return None
            v = json.loads(body)
            if v["fencing_token"] > tokens[i]:
                out["token_above"] += 1
            elif len(out["not_above"]) < 3:
                out["not_above"].append((key_of(i), tokens[i], v["fencing_token"]))
            tokens[i], lease_ids[i] = v["fencing_token"], v["lease_id"]
            renewed[i] = tuple(BATCH_TIMES)
        await run_ops(p_api, keys, lambda i: post("/v1/locks/acquire", {"key": key_of(i), "ttl_ms": ttl}),
                      on_acq2, 16, 4, deadline)
        return out

    def rebuild_line():
        try:
            with open(os.path.join(work, "fencegate.log"), errors="replace") as f:
                lines = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in f if "fence table rebuilt" in l]
        except OSError:
            return None
        if not lines:
            return None
        m = dict(re.findall(r"(\w+)=(\d+)", lines[-1]))
        return {k: int(v) for k, v in m.items() if k in ("fences", "live_grants", "elapsed_ms")}

    async def restart(kind, reacquire):
        nerr, errs = await renew_sample()
        if nerr:
            problems.append(f"{kind}: renewing the sample before the restart: {nerr} errors, first {errs[:2]}")
        await asyncio.sleep(2.0)  # so a restart that granted a fresh TTL would show (above the TTL left)
        t_sig = time.monotonic()
        stop_s = procs.stop("fencegate", sig=signal.SIGTERM if kind == "sigterm" else signal.SIGKILL, wait_s=60)
        t_start = time.monotonic()
        p = procs.start("fencegate", fg_argv, fg_env)
        ok = await wait_ready(p_api, min(120, max(1, deadline - time.monotonic())))
        t_ready = time.monotonic()
        if not ok:
            raise RuntimeError(f"{kind}: fencegate not ready after the restart")
        r = {"stop_ms": round(stop_s * 1000), "start_to_ready_ms": round((t_ready - t_start) * 1000),
             "signal_to_ready_ms": round((t_ready - t_sig) * 1000), "rebuild_log": rebuild_line()}
        await asyncio.sleep(0.5)
        r["rss_kib"] = rss_kib(p.pid)
        r["sample"] = await check_sample(t_start, t_ready)
        r["reacquire"] = await release_reacquire(reacquire)
        s, q = r["sample"], r["reacquire"]
        if s["held_same_token"] != len(sample):
            problems.append(f"{kind}: {s['wrong']} of {len(sample)} sampled leases not held with their token: {s['first_wrong']}")
        if s.get("full_ttl_from_restart", 0) != s["held_same_token"]:
            problems.append(f"{kind}: expires_in_ms is not the full TTL counted from the restart on "
                            f"{s['held_same_token'] - s.get('full_ttl_from_restart', 0)} sampled leases ({s.get('expires_in_ms')})")
        if q["token_above"] != len(reacquire) or q["released"] != len(reacquire):
            problems.append(f"{kind}: release + acquire: {q}")
        log(f"restart ({kind}): stop {r['stop_ms']} ms, start -> /readyz {r['start_to_ready_ms']} ms "
            f"(rebuild {r['rebuild_log']}); sample {s['held_same_token']}/{len(sample)} held with their token, "
            f"expires_in_ms = full TTL from the restart on {s.get('full_ttl_from_restart')}, "
            f"above the TTL left since the last renewal by {s.get('over_ttl_left_since_renewal_ms')} ms; next token above the last on "
            f"{q['token_above']}/{len(reacquire)} released keys")
        return r

    k = max(1, len(sample) // 10)
    res["restart_sigterm"] = await restart("sigterm", sample[:k])
    res["restart_kill9"] = await restart("kill9", sample[k:2 * k])
    procs.stop("fencegate")
    res["problems"] = problems
    return res


async def run_parts(a, procs, work, fg_bin, deadline):
    problems = []
    res = {"keys": a.keys, "parts": a.parts}
    if "fill" in a.parts:
        res.update(await main_async(a, procs, work, fg_bin, deadline))
        problems.extend(res.pop("problems"))
    if "mix" in a.parts:
        res["mix"] = await mix_phase(a, procs, work, fg_bin, deadline, problems)
    if "expiry" in a.parts:
        res["mass_expiry"] = await expiry_phase(a, procs, work, fg_bin, deadline, problems)
    if "expiry-control" in a.parts:
        res["mass_expiry_control"] = await expiry_phase(a, procs, work, fg_bin, deadline, problems, control=True)
    res["problems"] = problems
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=500_000)
    ap.add_argument("--smoke", action="store_true", help="N = 5,000 (unless --keys is given)")
    ap.add_argument("--ttl-ms", type=int, default=900_000)
    ap.add_argument("--sample", type=int, default=1000)
    ap.add_argument("--conns", type=int, default=64, help="fencegate connections")
    ap.add_argument("--depth", type=int, default=8, help="requests pipelined per fencegate connection")
    ap.add_argument("--redis-conns", type=int, default=8)
    ap.add_argument("--redis-batch", type=int, default=500, help="locks (SET + INCR) pipelined per Redis write")
    ap.add_argument("--parts", default="fill,mix,expiry",
                    help="comma-separated: fill (fill, memory and restarts), mix, expiry, expiry-control "
                         "(the expiry part's steps with nothing expiring: the figure's noise floor)")
    ap.add_argument("--mix-clients", type=int, default=64, help="closed-loop clients of the 1:1:1 mix")
    ap.add_argument("--mix-secs", type=float, default=10, help="length of the mix (smoke: 1)")
    ap.add_argument("--mix-rates", default=None,
                    help="offered rates (ops/s in all, comma-separated) of the open-loop mix after the "
                         "closed-loop one, each --mix-secs long (default 3000,6000,12000; smoke: 1000)")
    ap.add_argument("--expiry-slices", type=int, default=5, help="1-s fenced-PUT slices before the mass expiry")
    ap.add_argument("--expiry-after-s", type=float, default=6, help="fenced-PUT slices until this long after it")
    ap.add_argument("--budget-s", type=float, default=900, help="the whole run stops itself after this")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    if a.smoke and "--keys" not in " ".join(sys.argv):
        a.keys = 5000
    if a.smoke and "--mix-secs" not in " ".join(sys.argv):
        a.mix_secs = 1
    if a.mix_rates is None:
        a.mix_rates = "1000" if a.smoke else "3000,6000,12000"
    if a.smoke and "--expiry-slices" not in " ".join(sys.argv):
        a.expiry_slices = 2
    if a.smoke and "--expiry-after-s" not in " ".join(sys.argv):
        a.expiry_after_s = 2
    a.sample = min(a.sample, a.keys)
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = set(a.parts) - {"fill", "mix", "expiry", "expiry-control"}
    if unknown:
        sys.exit(f"unknown --parts {sorted(unknown)}: fill, mix, expiry, expiry-control")
    t_begin = time.monotonic()
    deadline = t_begin + a.budget_s - 30  # leaves time to stop everything

    def on_alarm(*_):
        raise Budget(f"the run exceeded its budget of {a.budget_s:.0f} s")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(a.budget_s - 15))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    fg_bin = os.environ.get("FENCEGATE_BIN") or os.path.join(ROOT, "target", "debug", "fencegate")
    if not os.access(fg_bin, os.X_OK):
        sys.exit(f"no fencegate binary at {fg_bin} (build it, or set FENCEGATE_BIN)")
    ensure_redis()
    work = tempfile.mkdtemp(prefix="fencegate-leases.")
    shutil.copy(fg_bin, os.path.join(work, "fencegate"))  # a snapshot: a rebuild cannot swap it mid-run
    ncpu = os.cpu_count() or 1
    server_cpu = 1 if ncpu >= 2 else None
    if server_cpu is not None:
        os.sched_setaffinity(0, {0})
    procs = Procs(work, server_cpu)
    rc = 0
    try:
        res = asyncio.run(run_parts(a, procs, work, os.path.join(work, "fencegate"), deadline))
        res["total_s"] = round(time.monotonic() - t_begin, 1)
        res["placement"] = ("servers on CPU 1, this client on CPU 0" if server_cpu is not None else "unpinned")
        res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        res["command"] = "python3 benches/compare/leases500k.py " + " ".join(sys.argv[1:])
        print(json.dumps(res, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        if res["problems"]:
            log("PROBLEMS: " + "; ".join(res["problems"]))
            rc = 1
        log(f"done in {res['total_s']} s")
    except (Budget, RuntimeError, OSError, asyncio.IncompleteReadError) as e:
        log(f"FAILED: {e!r}")
        rc = 1
    finally:
        signal.alarm(0)
        procs.stop_all()
        if os.environ.get("KEEP_WORK") == "1":
            log(f"scratch kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
