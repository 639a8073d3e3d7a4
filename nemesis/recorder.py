#!/usr/bin/env python3
"""The recording upstream of the nemesis harness (standard library only).

An HTTP/1.1 server that stands behind the gateway and *applies* writes:

* ``PUT /<resource>``: reads the whole body (Content-Length or chunked; a
  body cut short is never applied), then appends one JSON line
  ``{"seq", "resource", "token", "value", "arrival", "applied", "wall",
  "pid"}`` to the log and fsyncs it **before** answering 200. ``token`` is
  the ``X-Fencing-Token`` header the gateway forwarded (the recorder never
  checks it: judging tokens is the gateway's job, and the checker's).
  A write that carries ``X-Fencing-Sequence`` (the holder's number for
  it, forwarded by the gateway) is logged with ``"sequence": N`` too.
  ``arrival`` and ``applied`` are ``time.monotonic()`` readings (Linux
  CLOCK_MONOTONIC, shared by every process on the machine, so they order
  against the clients' own records).
* ``GET /<resource>``: the latest applied value (404 if none).
* A PUT with ``X-Nemesis-Hold-Ms: N`` (a header the gateway forwards like
  any other) is held after its body was read, then applied, N ms after its
  arrival or at the next ``POST /unhold`` on the control listener, whichever
  comes first: a slow upstream for that one request only (the
  gateway-stop-during-stall fault). N stands in for ``--request-timeout``
  for that request (it is never abandoned); the harness keeps N below the
  route's ``upstream_timeout_ms``, as the README's rule asks.

Control listener (``--control-port``, never reached through the gateway):

* ``POST /stall?seconds=N``: every data request waits until N seconds from
  now before it is served (reads and writes alike);
* ``POST /unhold``: every request held by ``X-Nemesis-Hold-Ms`` goes on now;
* ``GET /stats``: requests in flight, writes applied, stall left;
* ``GET /health``.

``SIGUSR1`` stalls for ``--signal-stall`` seconds too.

The recorder obeys the rule the gateway's README asks of a backend: it
applies a request within ``--request-timeout`` seconds of its arrival or
not at all (503 ``abandoned``), and that timeout is configured below the
gateway route's ``upstream_timeout_ms``.

It can be ``kill -9``'d at any instant: on start it re-reads its log
(dropping a torn last line), so ``seq`` continues and GET answers the last
applied value.
"""
import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, log_path, request_timeout):
        self.lock = threading.Lock()
        self.latest = {}  # resource -> (value, seq)
        self.seq = 0
        self.applied = 0
        self.abandoned = 0
        self.inflight = 0
        self.held = 0  # requests waiting out an X-Nemesis-Hold-Ms right now
        self.held_total = 0
        self.unhold_seq = 0  # bumped by POST /unhold: ends every hold
        self.count_lock = threading.Lock()
        self.stall_until = 0.0
        self.request_timeout = request_timeout
        self.log_path = log_path
        self._recover()
        self.fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _recover(self):
        if not os.path.exists(self.log_path):
            return
        with open(self.log_path, "rb") as f:
            data = f.read()
        good = data.rfind(b"\n") + 1
        if good < len(data):
            # A torn last line (kill -9 in the middle of a write): it was
            # never fsynced nor answered, so it was never applied.
            with open(self.log_path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        for line in data[:good].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            self.seq = max(self.seq, rec["seq"])
            self.latest[rec["resource"]] = (rec["value"], rec["seq"])

    def enter(self, n):
        with self.count_lock:
            self.inflight += n

    def hold(self, until):
        """Waits until `until` (monotonic) or the next POST /unhold, counted
        in `held` meanwhile."""
        with self.count_lock:
            self.held += 1
            self.held_total += 1
            seq = self.unhold_seq
        try:
            while True:
                left = until - time.monotonic()
                if left <= 0 or self.unhold_seq != seq:
                    return
                time.sleep(min(left, 0.02))
        finally:
            with self.count_lock:
                self.held -= 1

    def wait_stall(self):
        while True:
            left = self.stall_until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def apply(self, resource, token, value, arrival, sequence=None):
        with self.lock:
            self.seq += 1
            rec = {
                "seq": self.seq,
                "resource": resource,
                "token": token,
                "value": value,
                "arrival": arrival,
                "applied": time.monotonic(),
                "wall": time.time(),
                "pid": os.getpid(),
            }
            if sequence is not None:
                rec["sequence"] = sequence
            line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
            os.write(self.fd, line)
            os.fsync(self.fd)
            self.latest[resource] = (value, self.seq)
            self.applied += 1
            return self.seq


STATE = None


class DataHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Head and body go out in two writes: without TCP_NODELAY, Nagle plus
    # the gateway's delayed ACK add 40 ms to every answer.
    disable_nagle_algorithm = True
    server_version = "nemesis-recorder/1"

    def log_message(self, fmt, *args):  # quiet: the log file is the record
        pass

    def _resource(self):
        path = urllib.parse.urlsplit(self.path).path
        return urllib.parse.unquote(path.lstrip("/"))

    def _answer(self, status, body, headers=None):
        data = body if isinstance(body, bytes) else body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _read_body(self):
        """The whole body, or None if the peer went away before sending it."""
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te.lower():
            out = bytearray()
            while True:
                line = self.rfile.readline(1024)
                if not line.endswith(b"\n"):
                    return None
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers
                        t = self.rfile.readline(1024)
                        if not t.endswith(b"\n"):
                            return None
                        if t in (b"\r\n", b"\n"):
                            return bytes(out)
                chunk = self.rfile.read(size)
                if len(chunk) != size:
                    return None
                out += chunk
                if self.rfile.readline(8) not in (b"\r\n", b"\n"):
                    return None
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            return None
        return body

    def _hold(self):
        """Seconds of an ``X-Nemesis-Hold-Ms`` header, or None."""
        try:
            ms = float(self.headers.get("X-Nemesis-Hold-Ms", ""))
        except ValueError:
            return None
        return ms / 1000 if ms >= 0 else None

    def do_GET(self):
        STATE.enter(1)
        try:
            STATE.wait_stall()
            got = STATE.latest.get(self._resource())
            if got is None:
                self._answer(404, '{"error":"not_found"}')
            else:
                self._answer(200, got[0], {"X-Recorder-Seq": str(got[1])})
        finally:
            STATE.enter(-1)

    do_HEAD = do_GET

    def do_PUT(self):
        arrival = time.monotonic()
        STATE.enter(1)
        try:
            body = self._read_body()
            if body is None:
                # Cut off mid-body (e.g. the gateway aborted a superseded
                # upload): an incomplete request is never applied.
                self.close_connection = True
                return
            tok = self.headers.get("X-Fencing-Token")
            try:
                token = int(tok) if tok is not None else None
            except ValueError:
                token = tok
            sq = self.headers.get("X-Fencing-Sequence")
            try:
                sequence = int(sq) if sq is not None else None
            except ValueError:
                sequence = sq
            hold = self._hold()
            if hold is not None:
                STATE.hold(arrival + hold)
            STATE.wait_stall()
            if hold is None and time.monotonic() - arrival > STATE.request_timeout:
                STATE.abandoned += 1
                self._answer(503, '{"error":"abandoned","message":"request timeout passed before it could be applied"}')
                return
            seq = STATE.apply(self._resource(), token, body.decode("utf-8", "replace"), arrival, sequence)
            self._answer(200, json.dumps({"seq": seq}), {"X-Recorder-Seq": str(seq)})
        finally:
            STATE.enter(-1)

    do_POST = do_PUT


class ControlHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):
        pass

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stats(self):
        return {
            "pid": os.getpid(),
            "inflight": STATE.inflight,
            "applied": STATE.applied,
            "abandoned": STATE.abandoned,
            "held": STATE.held,
            "held_total": STATE.held_total,
            "seq": STATE.seq,
            "stall_left": max(0.0, STATE.stall_until - time.monotonic()),
        }

    def do_GET(self):
        if self.path.startswith("/stats") or self.path.startswith("/health"):
            self._json(200, self._stats())
        else:
            self._json(404, {"error": "not_found"})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/stall":
            q = urllib.parse.parse_qs(url.query)
            seconds = float(q.get("seconds", ["0"])[0])
            STATE.stall_until = max(STATE.stall_until, time.monotonic() + seconds)
            self._json(200, self._stats())
        elif url.path == "/unhold":
            with STATE.count_lock:
                STATE.unhold_seq += 1
            self._json(200, self._stats())
        else:
            self._json(404, {"error": "not_found"})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


def main():
    global STATE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--control-port", type=int, required=True)
    ap.add_argument("--log", required=True, help="JSONL log of applied writes")
    ap.add_argument("--request-timeout", type=float, default=6.0,
                    help="apply a request within this many seconds of its arrival or not at all")
    ap.add_argument("--signal-stall", type=float, default=3.0, help="SIGUSR1 stalls this many seconds")
    args = ap.parse_args()
    STATE = State(args.log, args.request_timeout)

    def on_usr1(signum, frame):
        STATE.stall_until = max(STATE.stall_until, time.monotonic() + args.signal_stall)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
    data = Server((args.host, args.port), DataHandler)
    ctl = Server((args.host, args.control_port), ControlHandler)
    threading.Thread(target=ctl.serve_forever, daemon=True).start()
    print(f"recorder pid={os.getpid()} data={args.host}:{args.port} control={args.host}:{args.control_port} "
          f"seq={STATE.seq}", file=sys.stderr, flush=True)
    data.serve_forever()


if __name__ == "__main__":
    main()
