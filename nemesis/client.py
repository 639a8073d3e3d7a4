#!/usr/bin/env python3
"""One workload client of the nemesis harness (standard library only).

Loops until ``--stop-at`` (a ``time.monotonic()`` reading; CLOCK_MONOTONIC
is shared by every process on the machine): acquire a lock on one of a few
resources with a short TTL (FIFO wait or not), then hold it for a few
cycles (a "job" of 0.05-1.5 s) of *read the resource through the gateway
→ think → write a value derived from what was read, with the token →
renew when half the TTL is gone by the lease clock (or forget to)*, then
release or let the lease run out.

Every operation is one JSON line in ``--record`` (flushed at once), with
``t0``/``t1`` the monotonic times it was sent and answered:

    {"ev":"acquire","c":"c3","key":"res/1","t0":..,"t1":..,"st":200,"token":41,"ttl":600,"wait":1200}
    {"ev":"read","c":"c3","key":"res/1","token":41,"t0":..,"t1":..,"st":200,"op":"c1:17"}
    {"ev":"write","c":"c3","key":"res/1","token":41,"sequence":2,"t0":..,"t1":..,"st":200,"op":"c3:9","prev":"c1:17"}
    {"ev":"renew"|"release"|"lost", ...}

``st`` is the HTTP status (null when the exchange failed: then ``err``),
``code`` the JSON error code of a refusal (``stale_fencing_token``, ...).

Each write carries ``X-Fencing-Sequence``: the writes of one grant are
numbered 1, 2, 3, ... (``sequence`` in the record), so the gateway refuses
a same-holder write that comes after a higher-numbered one (409
``stale_sequence``) and orders a higher one after the lower ones still in
flight.

A written value is ``{"op": <unique id>, "prev": <op it was derived
from>, "n": <counter>, "by": <client>, "tok": <token>}``: the checker
follows these links to find lost updates.

The client judges its own lease the way a real one would: a deadline
started before the acquire was sent, on its *lease clock* — monotonic
time plus an offset the harness may step (the clock-step nemesis writes
the offset to ``--clock-file`` and sends SIGUSR1). It checks the deadline
before each read, not before each write: a process stopped between its
read and its write (SIGSTOP, the GC-pause story) wakes up and writes with
the token it holds, exactly like the zombie of the story.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import sys
import time
import urllib.parse

mono = time.monotonic
CLOCK_OFFSET = 0.0
STOP = False


def lease_clock():
    return mono() + CLOCK_OFFSET


class Endpoint:
    """One persistent HTTP/1.1 connection; closed on any error, so a late
    answer can never be read as the answer to the next request."""

    def __init__(self, base):
        u = urllib.parse.urlsplit(base)
        self.host, self.port = u.hostname, u.port
        self.conn = None
        self.last_used = 0.0

    def close(self):
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn = None

    def request(self, method, path, body=None, headers=None, timeout=10.0):
        # The gateway may close idle connections; reopen rather than risk a
        # request on a connection the server already gave up.
        if self.conn is not None and mono() - self.last_used > 3.0:
            self.close()
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        else:
            self.conn.timeout = timeout
            if self.conn.sock is not None:
                self.conn.sock.settimeout(timeout)
        try:
            self.conn.request(method, path, body=body, headers=headers or {})
            r = self.conn.getresponse()
            data = r.read()
            self.last_used = mono()
            if r.will_close:
                self.close()
            return r.status, data, None
        except Exception as e:  # noqa: BLE001 - every failure is recorded
            self.close()
            return None, None, f"{type(e).__name__}: {e}"[:200]


def error_code(data):
    try:
        return json.loads(data).get("error")
    except (ValueError, AttributeError, TypeError):
        return None


def put_and_give_up(addr, path, headers, body, held, give_up_after):
    """One PUT on a connection of its own, given up on like a client whose
    timeout passed: sends it whole (chunked, so the gateway takes it on its
    general path, where the upstream exchange outlives the client's
    connection; the fast path takes Content-Length bodies only), waits
    until ``held()`` says the upstream holds it (at most ``give_up_after``
    s), then closes the connection without reading an answer.

    Returns ``(st, code, err, was_held)``: the status and error code if an
    answer came first (refused, or applied at once: nothing left in flight
    to give up on), else ``st`` None and ``was_held`` whether the upstream
    held it when the client gave up. This is how a holder produces the
    first half of a same-holder reordering (the harness's holder-retry and
    gateway-stop-during-stall faults)."""
    host = f"{addr[0]}:{addr[1]}"
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    req = (f"PUT {path} HTTP/1.1\r\nHost: {host}\r\n{head}Transfer-Encoding: chunked\r\n\r\n"
           f"{len(body):x}\r\n").encode() + body + b"\r\n0\r\n\r\n"
    st, code, err, was_held = None, None, None, False
    try:
        s = socket.create_connection(addr, timeout=2)
    except OSError as e:
        return None, None, f"connect: {e}"[:200], False
    try:
        s.sendall(req)
        until = mono() + give_up_after
        s.settimeout(0.01)
        while mono() < until:
            if held():
                was_held = True
                break
            try:
                got = s.recv(65536)
            except socket.timeout:
                continue
            m = re.match(rb"HTTP/1\.1 (\d{3})", got or b"")
            st = int(m.group(1)) if m else None
            err = None if m else "closed without an answer"
            if m:
                code = error_code(got.split(b"\r\n\r\n", 1)[-1])
            break
        else:
            err = "no answer and not held at the upstream; gave up"
        if was_held:
            err = "nemesis: the client gave up while the upstream held the write"
    except OSError as e:
        err = f"{type(e).__name__}: {e}"[:200]
    finally:
        s.close()
    return st, code, err, was_held


class Client:
    def __init__(self, args):
        self.id = args.id
        self.rng = random.Random(args.seed)
        self.api = Endpoint(args.api)
        self.proxy = Endpoint(args.proxy)
        self.resources = args.resources.split(",")
        self.ttl_min, self.ttl_max = args.ttl_min, args.ttl_max
        self.stop_at = args.stop_at
        self.rec = open(args.record, "a", buffering=1)
        self.nops = 0

    def record(self, **kv):
        kv["c"] = self.id
        if CLOCK_OFFSET:
            kv["clock_offset"] = CLOCK_OFFSET
        self.rec.write(json.dumps(kv, separators=(",", ":")) + "\n")
        self.rec.flush()

    def api_call(self, verb, body, timeout):
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        return self.api.request("POST", f"/v1/locks/{verb}", data, headers, timeout)

    def done(self):
        return STOP or mono() >= self.stop_at

    def run(self):
        while not self.done():
            self.one_lease()
        self.api.close()
        self.proxy.close()

    def one_lease(self):
        rng = self.rng
        key = rng.choice(self.resources)
        ttl = rng.randint(self.ttl_min, self.ttl_max)
        wait = 0 if rng.random() < 0.2 else rng.randint(100, 2000)
        started = lease_clock()  # the deadline starts before the request is sent
        t0 = mono()
        st, data, err = self.api_call("acquire", {"key": key, "ttl_ms": ttl, "wait_ms": wait, "holder": self.id},
                                      timeout=wait / 1000 + 20)
        t1 = mono()
        if st != 200:
            self.record(ev="acquire", key=key, t0=t0, t1=t1, st=st, err=err, code=error_code(data), ttl=ttl, wait=wait)
            time.sleep(rng.uniform(0.02, 0.1) if st == 409 else rng.uniform(0.05, 0.25))
            return
        grant = json.loads(data)
        token, lease_id = grant["fencing_token"], grant["lease_id"]
        self.record(ev="acquire", key=key, t0=t0, t1=t1, st=st, token=token, ttl=ttl, wait=wait)
        sequence = 0  # X-Fencing-Sequence of this grant's writes: 1, 2, 3, ...
        deadline = started + ttl / 1000
        margin = 0.05
        lost = False
        if t1 - t0 > ttl / 3000:
            # Waited in the queue: the local deadline (counted from before the
            # request) is nearly gone. Renew at once to move it up to a fresh
            # bound, as the Rust client does.
            sent = lease_clock()
            t0 = mono()
            st, data, err = self.api_call("renew", {"key": key, "lease_id": lease_id}, timeout=5)
            self.record(ev="renew", key=key, token=token, t0=t0, t1=mono(), st=st, err=err)
            if st == 200:
                deadline = sent + ttl / 1000
            elif st == 410:
                lost = True
        job_end = mono() + rng.uniform(0.05, 1.5)  # how long this holder works under the lock
        while not lost and mono() < job_end:
            if self.done():
                break
            if lease_clock() >= deadline - margin:
                self.record(ev="lost", key=key, token=token, t0=mono(), why="local deadline")
                lost = True
                break
            # read
            t0 = mono()
            st, data, err = self.proxy.request("GET", "/" + key, headers={"X-Fencing-Token": str(token)}, timeout=15)
            t1 = mono()
            prev, n = None, 0
            if st == 200:
                try:
                    v = json.loads(data)
                    prev, n = v["op"], v["n"]
                except (ValueError, KeyError, TypeError):
                    prev = "?unparseable"
            self.record(ev="read", key=key, token=token, t0=t0, t1=t1, st=st, err=err,
                        code=error_code(data) if st not in (200, None) else None, op=prev)
            if st == 409:
                lost = True
                break
            if st not in (200, 404):
                time.sleep(rng.uniform(0.05, 0.15))  # gateway or upstream down: retry soon
                continue
            # think (the window a GC pause or SIGSTOP most often lands in)
            time.sleep(rng.uniform(0.01, 0.12))
            # write, derived from what was read
            self.nops += 1
            sequence += 1
            op = f"{self.id}:{self.nops}"
            value = json.dumps({"op": op, "prev": prev, "n": n + 1, "by": self.id, "tok": token},
                               separators=(",", ":"))
            t0 = mono()
            st, data, err = self.proxy.request("PUT", "/" + key, value.encode(),
                                               {"X-Fencing-Token": str(token), "X-Fencing-Sequence": str(sequence),
                                                "Content-Type": "application/json"},
                                               timeout=15)
            t1 = mono()
            self.record(ev="write", key=key, token=token, sequence=sequence, t0=t0, t1=t1, st=st, err=err,
                        code=error_code(data) if st is not None and st >= 300 else None, op=op, prev=prev,
                        value=value)
            if st in (409, 403):
                # stale_fencing_token, lease_expired (stale_sequence cannot
                # happen: every write of this grant has a new number)
                lost = True
                break
            # renew, or not: when the lease clock says half the TTL is gone
            # (mostly; sometimes the client forgets)
            if deadline - lease_clock() < ttl / 2000 and rng.random() < 0.85:
                sent = lease_clock()
                t0 = mono()
                st, data, err = self.api_call("renew", {"key": key, "lease_id": lease_id}, timeout=5)
                self.record(ev="renew", key=key, token=token, t0=t0, t1=mono(), st=st, err=err)
                if st == 200:
                    deadline = sent + ttl / 1000
                elif st == 410:
                    lost = True
                    break
        if not lost and rng.random() < 0.75:
            t0 = mono()
            st, data, err = self.api_call("release", {"key": key, "lease_id": lease_id}, timeout=5)
            self.record(ev="release", key=key, token=token, t0=t0, t1=mono(), st=st, err=err)
        time.sleep(rng.uniform(0, 0.03))


def main():
    global CLOCK_OFFSET
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--id", required=True)
    ap.add_argument("--api", required=True, help="lease API base URL")
    ap.add_argument("--proxy", required=True, help="fenced proxy base URL")
    ap.add_argument("--resources", default="res/0,res/1,res/2")
    ap.add_argument("--ttl-min", type=int, default=300)
    ap.add_argument("--ttl-max", type=int, default=1000)
    ap.add_argument("--record", required=True)
    ap.add_argument("--stop-at", type=float, required=True, help="time.monotonic() at which to stop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock-file", help="lease-clock offset in seconds, re-read on SIGUSR1")
    args = ap.parse_args()

    def on_usr1(signum, frame):
        global CLOCK_OFFSET
        try:
            with open(args.clock_file) as f:
                CLOCK_OFFSET = float(f.read().strip() or 0)
        except (OSError, ValueError, TypeError):
            pass

    def on_term(signum, frame):
        global STOP
        STOP = True

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    c = Client(args)
    c.record(ev="start", t0=mono(), pid=os.getpid())
    try:
        c.run()
    finally:
        c.record(ev="stop", t0=mono())
    return 0


if __name__ == "__main__":
    sys.exit(main())
