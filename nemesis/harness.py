#!/usr/bin/env python3
"""Jepsen-style nemesis harness for fencegate (standard library only).

Starts, on loopback (or in network namespaces it creates itself):

* the recording upstream (``recorder.py``), which appends every applied
  write to ``recorder.jsonl`` and fsyncs it before answering;
* the gateway (``fencegate serve --config``), one catch-all route to the
  recorder, ``enforce = true`` — or ``enforce = false`` (shadow mode) with
  ``--unfenced``, the self-test;
* N workload clients (``client.py``), each writing its own record;

then runs a nemesis schedule — one fault at a time, each bounded in time,
followed by a quiet gap at least as long as the liveness bound:

  pause          SIGSTOP the client holding a lease for longer than any
                 TTL, then SIGCONT (the GC-pause story, for real processes)
  gateway-kill   kill -9 the gateway, restart it on the same data dir
  upstream-stall the recorder stalls every request for seconds
  upstream-kill  the recorder stalls, requests pile up, kill -9 it
                 mid-request, restart it
  partition      cut client c0 off from the gateway: its side of a veth
                 pair between two network namespaces goes down (packets
                 are dropped); where namespaces cannot be made, a loopback
                 TCP proxy of the harness's stalls c0's traffic instead
  clock-step     step a lease holder's lease clock back by seconds, then
                 forward again (simulated in the client process: the
                 system clock is shared with the gateway and not touched)
  gateway-kill-during-stall   kill -9 the gateway while the upstream is
                 stalled with requests the gateway forwarded in flight
  gateway-stop-during-stall   the harness, as a recorded holder, sends a
                 write the upstream holds, gives up on it (closes its
                 connection), SIGTERMs the gateway and restarts it at once,
                 then a newer holder is granted and writes before the held
                 write goes on: the clean stop must have waited for it
  holder-retry   the harness, as a recorded holder, numbers its writes
                 (X-Fencing-Sequence): write n is held by the upstream and
                 given up on, write n+1 goes on a new connection (it must
                 wait for n), then n is retried (it must be refused with
                 409 stale_sequence): same-holder ordering

and finally runs ``checker.py`` over the histories and prints its summary.

Exit status: 0 clean; 1 anomalies (or, with ``--unfenced``, NO safety
anomaly found: the self-test failed); 2 the harness itself failed.

    python3 nemesis/harness.py --duration 90
    python3 nemesis/harness.py --unfenced --duration 30
    python3 nemesis/harness.py --duration 600 --out /tmp/soak
"""
import argparse
import atexit
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checker  # noqa: E402
import client as wl  # noqa: E402  (the workload client: its HTTP endpoint and record format)

mono = time.monotonic
LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
CLONE_NEWNET = 0x40000000
DEFAULT_FAULTS = ["pause", "gateway-kill", "upstream-stall", "upstream-kill", "partition", "clock-step",
                  "gateway-kill-during-stall", "gateway-stop-during-stall", "holder-retry"]
ALL_FAULTS = DEFAULT_FAULTS
# The route's upstream_timeout_ms. The recorder abandons what it did not
# apply within --upstream-request-timeout (< this), as the README asks; after
# a kill -9 the gateway quarantines new grants for this long.
UPSTREAM_TIMEOUT_MS = 3000
T_START = mono()


def log(msg):
    print(f"[{mono() - T_START:7.1f}s] {msg}", flush=True)


def die_with_parent():
    # Children are killed if the harness dies without cleaning up.
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def setns(fd):
    if LIBC.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=2.0):
    """(status, parsed JSON or text) or (None, error)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (OSError, ValueError) as e:
        return None, str(e)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


class Proc:
    """A child process started, killed and restarted by PID."""

    def __init__(self, name, argv, log_path):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.p = None
        self.starts = 0

    def start(self):
        with open(self.log_path, "ab") as f:
            f.write(f"\n=== {self.name} start #{self.starts + 1} at monotonic {mono():.3f} ===\n".encode())
            f.flush()
            self.p = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=die_with_parent)
        self.starts += 1
        return self.p.pid

    @property
    def pid(self):
        return self.p.pid if self.p else None

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            try:
                os.kill(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self, within=5.0):
        """SIGSTOP, then waits until every thread of the process is stopped.
        A stop takes effect only when the kernel next schedules the thread
        it picked to take it: on a busy machine the process can go on for
        milliseconds after kill() returned (forward a request sent after
        it, say). Returns the seconds the stop took to take hold, or None
        if it did not within `within` s (or the process is gone)."""
        if not self.alive():
            return None
        t0 = mono()
        self.signal(signal.SIGSTOP)
        task_dir = f"/proc/{self.p.pid}/task"
        while mono() - t0 < within:
            try:
                states = []
                for tid in os.listdir(task_dir):
                    with open(f"{task_dir}/{tid}/stat") as f:
                        # The state follows the command name's closing parenthesis.
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                return None
            if states and all(s in ("T", "t") for s in states):
                return mono() - t0
            time.sleep(0.0005)
        return None

    def kill9(self):
        if self.p is None:
            return
        self.signal(signal.SIGKILL)
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace=10.0):
        """SIGTERM, then SIGKILL after `grace` seconds. Returns the exit code."""
        if self.p is None:
            return None
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.p.poll()


# ---------------------------------------------------------------- networks

class LoopbackNet:
    """Everything on 127.0.0.1 of the current namespace; c0 goes through a
    TCP proxy of the harness that can stall all of its traffic."""

    method = "tcp-proxy"
    gw_host = "127.0.0.1"

    def __init__(self):
        self.healed = threading.Event()
        self.healed.set()
        self.proxies = []

    def setup(self):
        pass

    def client_endpoints(self, api, proxy):
        """The partitioned client's (api, proxy) base URLs: through the cut proxies."""
        a = CutProxy(api, self.healed)
        p = CutProxy(proxy, self.healed)
        self.proxies += [a, p]
        return f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{p.port}"

    def wrap(self, argv, partitioned):
        return argv

    def cut(self):
        self.healed.clear()

    def heal(self):
        self.healed.set()

    def teardown(self):
        self.heal()
        for p in self.proxies:
            p.close()


class CutProxy:
    """Loopback TCP proxy to one listener. While cut, no byte moves in either
    direction and new connections are held (like a partition during which
    TCP retransmits); on heal everything flows again."""

    def __init__(self, target_url, healed):
        host, port = target_url.rsplit("/", 1)[-1].split(":")
        self.target = (host, int(port))
        self.healed = healed
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(128)
        self.port = self.ls.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c):
        self.healed.wait()
        try:
            u = socket.create_connection(self.target, timeout=5)
            u.settimeout(None)
        except OSError:
            c.close()
            return
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while True:
                data = src.recv(65536)
                self.healed.wait()
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
        except OSError:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.closed = True
        try:
            self.ls.close()
        except OSError:
            pass


class NetnsNet:
    """Two network namespaces made by the harness, joined by a veth pair in a
    private /30: G (gateway, recorder, clients c1.., and the harness itself)
    and C (client c0 alone). The gateway listens on G's veth address
    10.213.0.1, which every process reaches (from G over G's own local
    route, from C over the veth). A partition sets G's end of the veth down:
    C's packets are dropped, G keeps working. No address outside the two
    namespaces is touched."""

    method = "netns"
    gw_host = "10.213.0.1"
    client_host = "10.213.0.2"

    def __init__(self):
        tag = f"fgn{os.getpid()}"
        self.g, self.c = tag + "g", tag + "c"
        self.created = []
        self.root_fd = None

    @staticmethod
    def ip(*args):
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    @staticmethod
    def reap_stale():
        """Deletes namespaces left by harness runs that died uncleanly."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
        for line in r.stdout.splitlines():
            m = re.match(r"^(fgn(\d+)[gc])\b", line)
            if m and not os.path.exists(f"/proc/{m.group(2)}"):
                subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True, timeout=10)

    def setup(self):
        if shutil.which("ip") is None:
            raise RuntimeError("iproute2 (ip) not installed")
        self.reap_stale()
        g, c = self.g, self.c
        self.ip("netns", "add", g)
        self.created.append(g)
        self.ip("netns", "add", c)
        self.created.append(c)
        self.ip("-n", g, "link", "add", "vg", "type", "veth", "peer", "name", "vc", "netns", c)
        self.ip("-n", g, "addr", "add", self.gw_host + "/30", "dev", "vg")
        self.ip("-n", c, "addr", "add", self.client_host + "/30", "dev", "vc")
        for ns, dev in ((g, "lo"), (c, "lo"), (g, "vg"), (c, "vc")):
            self.ip("-n", ns, "link", "set", dev, "up")
        self.root_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{g}", os.O_RDONLY)
        try:
            setns(fd)  # the harness (and every child it starts) now lives in G
        finally:
            os.close(fd)
        self._self_test()

    def _probe(self, port, timeout):
        code = (f"import socket; socket.create_connection(('{self.gw_host}', {port}), timeout={timeout}).close()")
        r = subprocess.run(["ip", "netns", "exec", self.c, sys.executable, "-c", code], capture_output=True,
                           timeout=timeout + 10)
        return r.returncode == 0

    def _self_test(self):
        """C reaches G over the veth, and a cut really stops it."""
        ls = socket.socket()
        ls.bind((self.gw_host, 0))
        ls.listen(8)
        port = ls.getsockname()[1]
        try:
            if not self._probe(port, 2):
                raise RuntimeError("namespace C cannot reach G over the veth")
            self.cut()
            try:
                if self._probe(port, 0.5):
                    raise RuntimeError("a cut veth still carried a connection")
            finally:
                self.heal()
            deadline = mono() + 5
            while not self._probe(port, 1):
                if mono() > deadline:
                    raise RuntimeError("the veth did not come back after heal")
        finally:
            ls.close()

    def client_endpoints(self, api, proxy):
        return api, proxy

    def wrap(self, argv, partitioned):
        return ["ip", "netns", "exec", self.c, *argv] if partitioned else argv

    def cut(self):
        self.ip("-n", self.g, "link", "set", "vg", "down")

    def heal(self):
        self.ip("-n", self.g, "link", "set", "vg", "up")

    def teardown(self):
        if self.root_fd is not None:
            try:
                setns(self.root_fd)
            except OSError:
                pass
            os.close(self.root_fd)
            self.root_fd = None
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.created = []


# ---------------------------------------------------------------- the run

class RecordedHolder:
    """A lock holder played by the harness itself, with its own record in
    ``clients/<id>.jsonl`` in client.py's exact format (acquire, read,
    write, release lines), so the checker judges its grants and writes like
    any client's: its token is a granted one, and a write of it applied
    after a newer grant is ``superseded-applied``."""

    def __init__(self, cid, out, api, proxy):
        self.id = cid
        self.api, self.proxy = wl.Endpoint(api), wl.Endpoint(proxy)
        u = urllib.parse.urlsplit(proxy)
        self.proxy_addr = (u.hostname, u.port)
        self.rec = open(os.path.join(out, "clients", f"{cid}.jsonl"), "a", buffering=1)
        self.nops = 0

    def record(self, **kv):
        kv["c"] = self.id
        self.rec.write(json.dumps(kv, separators=(",", ":")) + "\n")
        self.rec.flush()

    def api_call(self, verb, body, timeout):
        return self.api.request("POST", f"/v1/locks/{verb}", json.dumps(body).encode(),
                                {"Content-Type": "application/json"}, timeout)

    def acquire(self, key, ttl, wait):
        """(token, lease_id) or (None, None)."""
        t0 = mono()
        st, data, err = self.api_call("acquire", {"key": key, "ttl_ms": ttl, "wait_ms": wait, "holder": self.id},
                                      timeout=wait / 1000 + 5)
        t1 = mono()
        if st != 200:
            self.record(ev="acquire", key=key, t0=t0, t1=t1, st=st, err=err, code=wl.error_code(data), ttl=ttl,
                        wait=wait)
            return None, None
        grant = json.loads(data)
        self.record(ev="acquire", key=key, t0=t0, t1=t1, st=st, token=grant["fencing_token"], ttl=ttl, wait=wait)
        return grant["fencing_token"], grant["lease_id"]

    def read(self, key, token):
        """(ok, op read, its n)."""
        t0 = mono()
        st, data, err = self.proxy.request("GET", "/" + key, headers={"X-Fencing-Token": str(token)}, timeout=5)
        prev, n = None, 0
        if st == 200:
            try:
                v = json.loads(data)
                prev, n = v["op"], v["n"]
            except (ValueError, KeyError, TypeError):
                prev = "?unparseable"
        self.record(ev="read", key=key, token=token, t0=t0, t1=mono(), st=st, err=err,
                    code=wl.error_code(data) if st not in (200, None) else None, op=prev)
        return st in (200, 404), prev, n

    def value(self, prev, n, token):
        self.nops += 1
        op = f"{self.id}:{self.nops}"
        return op, json.dumps({"op": op, "prev": prev, "n": n + 1, "by": self.id, "tok": token},
                              separators=(",", ":"))

    def write(self, key, token, prev, n, sequence=None, op_value=None, fresh=False):
        """An ordinary write (small body, Content-Length: the fast path,
        unless it carries a sequence). With `sequence`, it carries
        X-Fencing-Sequence; `op_value` re-sends a value already written
        (a retry); `fresh` sends it on a new connection. Returns (st, code)."""
        op, value = op_value or self.value(prev, n, token)
        headers = {"X-Fencing-Token": str(token), "Content-Type": "application/json"}
        if sequence is not None:
            headers["X-Fencing-Sequence"] = str(sequence)
        if fresh:
            self.proxy.close()
        t0 = mono()
        st, data, err = self.proxy.request("PUT", "/" + key, value.encode(), headers, timeout=10)
        code = wl.error_code(data) if st is not None and st >= 300 else None
        extra = {} if sequence is None else {"sequence": sequence}
        self.record(ev="write", key=key, token=token, **extra, t0=t0, t1=mono(), st=st, err=err, code=code, op=op,
                    prev=prev, value=value)
        return st, code

    def send_abandoned_write(self, key, token, prev, n, hold_ms, held, give_up_after, sequence=None):
        """Sends a write the recorder holds `hold_ms` from its arrival, waits
        until `held()` says the recorder holds it (at most `give_up_after`
        s), then gives up: closes the connection without an answer, like a
        client whose timeout passed (client.put_and_give_up: chunked, so on
        the gateway's general path, where the upstream exchange outlives
        the client's connection). Returns (was_held, (op, value))."""
        op, value = self.value(prev, n, token)
        headers = {"X-Fencing-Token": str(token), "Content-Type": "application/json",
                   "X-Nemesis-Hold-Ms": str(hold_ms)}
        extra = {}
        if sequence is not None:
            headers["X-Fencing-Sequence"] = str(sequence)
            extra["sequence"] = sequence
        t0 = mono()
        st, code, err, was_held = wl.put_and_give_up(self.proxy_addr, "/" + key, headers, value.encode(), held,
                                                     give_up_after)
        self.record(ev="write", key=key, token=token, **extra, t0=t0, t1=mono(), st=st, err=err, code=code, op=op,
                    prev=prev, value=value)
        return was_held, (op, value)

    def release(self, key, token, lease_id):
        t0 = mono()
        st, data, err = self.api_call("release", {"key": key, "lease_id": lease_id}, timeout=5)
        self.record(ev="release", key=key, token=token, t0=t0, t1=mono(), st=st, err=err)
        return st

    def reconnect(self):
        """Forgets kept-alive connections (the gateway was restarted)."""
        self.api.close()
        self.proxy.close()

    def close(self):
        self.reconnect()
        self.rec.close()


class Harness:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.out = args.out
        self.ttl_min, self.ttl_max = args.ttl_min, args.ttl_max
        # Liveness bound: a lease left by a paused/cut/killed holder lasts at
        # most one TTL (a restarted gateway restores it with a full TTL); after
        # a kill -9 the gateway also holds new grants back for the route's
        # upstream_timeout_ms (its quarantine: the dead process's requests may
        # still be applied until then); plus 3 s of slack for a gateway restart
        # to listening (0.04-0.13 s measured here), the clients' retry backoff
        # (<= 0.25 s), a recorder fsync per write and the scheduling noise of
        # ~10 processes on 2 cores.
        self.bound = self.ttl_max / 1000 + UPSTREAM_TIMEOUT_MS / 1000 + args.liveness_slack
        self.net = None
        self.recorder = self.gateway = None
        self.clients = []
        self.faults_file = None
        self.unexpected = []
        self.cleaned = False
        self.run_info = {}
        self.zombie = self.successor = None  # the harness's own recorded holders (gateway-stop-during-stall)
        self.retrier = None  # and the one of holder-retry

    # -- setup
    def choose_net(self):
        want = self.args.partition
        if want in ("auto", "netns"):
            net = NetnsNet()
            try:
                net.setup()
                return net
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                net.teardown()
                if want == "netns":
                    raise
                log(f"network namespaces unavailable ({e}); falling back to the loopback TCP proxy")
        net = LoopbackNet()
        net.setup()
        return net

    def start(self):
        a = self.args
        os.makedirs(os.path.join(self.out, "clients"), exist_ok=True)
        for f in ("recorder.jsonl", "nemesis.jsonl"):
            if os.path.exists(os.path.join(self.out, f)):
                raise RuntimeError(f"{self.out} already holds a run; use a fresh --out")
        self.net = self.choose_net()
        log(f"partition method: {self.net.method}")
        gw = self.net.gw_host
        rport, cport = free_port("127.0.0.1"), free_port("127.0.0.1")
        self.ctl = f"http://127.0.0.1:{cport}"
        pport, aport = free_port(gw), free_port(gw)
        self.api, self.proxy = f"http://{gw}:{aport}", f"http://{gw}:{pport}"
        py = sys.executable
        self.recorder = Proc("recorder", [py, os.path.join(HERE, "recorder.py"), "--port", str(rport),
                                          "--control-port", str(cport), "--log",
                                          os.path.join(self.out, "recorder.jsonl"),
                                          "--request-timeout", str(a.upstream_request_timeout)],
                             os.path.join(self.out, "recorder.log"))
        self.recorder.start()
        self.wait_recorder()
        conf = os.path.join(self.out, "gateway.toml")
        with open(conf, "w") as f:
            f.write(f"""# written by nemesis/harness.py ({'UNFENCED self-test: shadow mode' if a.unfenced else 'fenced'})
data_dir = "{os.path.join(self.out, 'gw-data')}"
listen = "{gw}:{pport}"
api_listen = "{gw}:{aport}"
log_level = "{a.gateway_log_level}"

[locks]
# Longer than upstream_timeout_ms, so activation always outlives an older request.
activation_timeout_ms = {2 * UPSTREAM_TIMEOUT_MS}

[[routes]]
name = "nemesis"
match = "/{{*path}}"
upstream = "http://127.0.0.1:{rport}"
enforce = {'false' if a.unfenced else 'true'}
# Longer than the recorder's own request timeout ({a.upstream_request_timeout} s), as the README asks.
upstream_timeout_ms = {UPSTREAM_TIMEOUT_MS}
connect_timeout_ms = 1000
""")
        r = subprocess.run([a.binary, "check-config", conf], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"gateway config refused: {r.stdout}{r.stderr}")
        self.gateway = Proc("gateway", [a.binary, "serve", "--config", conf], os.path.join(self.out, "gateway.log"))
        self.gateway.start()
        self.wait_gateway()
        self.t0 = mono()
        self.stop_at = self.t0 + a.duration
        self.faults_file = open(os.path.join(self.out, "nemesis.jsonl"), "a", buffering=1)
        names = [f"c{i}" for i in range(a.clients)]
        for i, name in enumerate(names):
            partitioned = i == 0
            api, proxy = self.net.client_endpoints(self.api, self.proxy) if partitioned else (self.api, self.proxy)
            argv = [py, os.path.join(HERE, "client.py"), "--id", name, "--api", api, "--proxy", proxy,
                    "--resources", ",".join(f"res/{k}" for k in range(a.resources)),
                    "--ttl-min", str(self.ttl_min), "--ttl-max", str(self.ttl_max),
                    "--record", os.path.join(self.out, "clients", f"{name}.jsonl"),
                    "--stop-at", f"{self.stop_at:.3f}", "--seed", str(a.seed * 1000 + i),
                    "--clock-file", os.path.join(self.out, "clients", f"{name}.clock")]
            p = Proc(name, self.net.wrap(argv, partitioned), os.path.join(self.out, "clients", f"{name}.log"))
            p.start()
            self.clients.append(p)
        self.run_info = {
            "mode": "unfenced" if a.unfenced else "fenced", "partition_method": self.net.method,
            "partitioned_client": "c0", "clients": a.clients, "resources": a.resources, "seed": a.seed,
            "duration_s": a.duration, "ttl_min_ms": self.ttl_min, "ttl_max_ms": self.ttl_max,
            "liveness_bound_s": self.bound, "start": self.t0, "stop_at": self.stop_at,
            "faults_enabled": a.faults, "first_faults": a.first_faults, "binary": a.binary,
            "gateway_api": self.api, "gateway_proxy": self.proxy,
            "upstream_request_timeout_s": a.upstream_request_timeout, "argv": sys.argv,
        }
        self.write_run()
        log(f"{a.clients} clients on {a.resources} resources, TTL {self.ttl_min}-{self.ttl_max} ms, "
            f"gateway api {self.api} proxy {self.proxy} ({'UNFENCED shadow mode' if a.unfenced else 'fenced'})")

    def write_run(self):
        self.run_info["unexpected_exits"] = self.unexpected
        with open(os.path.join(self.out, "run.json"), "w") as f:
            json.dump(self.run_info, f, indent=2)

    def wait_recorder(self, timeout=15):
        deadline = mono() + timeout
        while mono() < deadline:
            st, _ = http("GET", self.ctl + "/health", timeout=1)
            if st == 200:
                return mono()
            if not self.recorder.alive():
                break
            time.sleep(0.05)
        raise RuntimeError("the recorder did not come up (see recorder.log)")

    def wait_gateway(self, timeout=30):
        deadline = mono() + timeout
        while mono() < deadline:
            st, _ = http("GET", self.api + "/readyz", timeout=1)
            if st == 200:
                return mono()
            if not self.gateway.alive():
                raise RuntimeError(f"the gateway exited with {self.gateway.p.returncode} (see gateway.log)")
            time.sleep(0.02)
        raise RuntimeError("the gateway did not become ready (see gateway.log)")

    # -- nemesis
    def record_fault(self, **kv):
        self.faults_file.write(json.dumps(kv, separators=(",", ":")) + "\n")
        extra = {k: v for k, v in kv.items() if k not in ("kind", "start", "end")}
        log(f"fault {kv['kind']:<26} {kv['end'] - kv['start']:5.2f}s  {json.dumps(extra)}")

    def pick_holder(self):
        """A client that holds a lease right now (from the status API), else any."""
        holders = []
        for k in range(self.args.resources):
            st, body = http("GET", f"{self.api}/v1/locks/status?key=res/{k}", timeout=1)
            if st == 200 and isinstance(body, dict) and body.get("held"):
                holders.append(body.get("holder"))
        byname = {c.name: c for c in self.clients if c.alive()}
        cands = [byname[h] for h in holders if h in byname]
        return self.rng.choice(cands or list(byname.values())), bool(cands)

    def last_event(self, c):
        """The last record line of client `c` (its current phase)."""
        try:
            with open(os.path.join(self.out, "clients", f"{c.name}.jsonl"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().splitlines()
            return json.loads(lines[-1]) if lines else {}
        except (OSError, ValueError):
            return {}

    def wait_in_think(self, c, up_to):
        """Waits (at most `up_to` s) until client `c` is between a read and
        its write: the last line of its record is a successful read."""
        look_until = mono() + up_to
        while mono() < look_until:
            ev = self.last_event(c)
            if ev.get("ev") == "read" and ev.get("st") in (200, 404):
                return True
            time.sleep(0.005)
        return False

    def fault_pause(self):
        """Stops a lease holder, preferably between its read and its write
        (its record's last line is a successful read: it is thinking), for
        longer than any TTL: on SIGCONT it writes with the token it holds."""
        c, held = self.pick_holder()
        d = self.rng.uniform(self.ttl_max / 1000 + 0.5, self.ttl_max / 1000 + 2.5)
        in_think = held and self.wait_in_think(c, 1.0)
        start = mono()
        c.signal(signal.SIGSTOP)
        time.sleep(d)
        c.signal(signal.SIGCONT)
        self.record_fault(kind="pause", start=start, end=mono(), target=c.name, pid=c.pid, was_holder=held,
                          between_read_and_write=in_think)

    def fault_gateway_kill(self):
        start = mono()
        self.gateway.kill9()
        down = self.rng.uniform(0.2, 1.5)
        time.sleep(down)
        self.gateway.start()
        end = mono()
        ready = self.wait_gateway()
        self.record_fault(kind="gateway-kill", start=start, end=end, ready_after_s=round(ready - end, 3),
                          down_s=round(down, 3), pid=self.gateway.pid)

    def fault_upstream_stall(self):
        d = self.rng.uniform(1.5, 4.0)
        st, _ = http("POST", f"{self.ctl}/stall?seconds={d:.3f}")
        start = mono()
        time.sleep(d)
        self.record_fault(kind="upstream-stall", start=start, end=mono(), seconds=round(d, 3), ok=st == 200)

    def fault_upstream_kill(self):
        http("POST", f"{self.ctl}/stall?seconds=60")
        start = mono()
        time.sleep(self.rng.uniform(0.3, 1.0))  # let requests pile up inside the recorder
        st, stats = http("GET", f"{self.ctl}/stats", timeout=1)
        inflight = stats.get("inflight") if st == 200 and isinstance(stats, dict) else None
        self.recorder.kill9()
        time.sleep(self.rng.uniform(0.2, 1.0))
        self.recorder.start()
        end = mono()
        self.wait_recorder()
        self.record_fault(kind="upstream-kill", start=start, end=end, inflight_at_kill=inflight,
                          pid=self.recorder.pid)

    def fault_partition(self):
        victim = self.clients[0]
        d = self.rng.uniform(2.0, 5.0)
        # Strike while c0 is mid-operation (read done, write to come) if it
        # gets there within 1.5 s: its write then leaves into the cut.
        in_think = self.wait_in_think(victim, 1.5)
        start = mono()
        self.net.cut()
        try:
            time.sleep(d)
        finally:
            self.net.heal()
        self.record_fault(kind="partition", start=start, end=mono(), target=victim.name, method=self.net.method,
                          between_read_and_write=in_think)

    def fault_clock_step(self):
        """Steps the lease clock of a holder (see client.py): either one step
        back by seconds ("step"), or back by 0.2 s every 0.2 s ("strobe": a
        clock that stands still), then forward to true time again. The
        client then believes its lease lasts longer than it does, skips
        renewals and writes on after the gateway expired it."""
        c, held = self.pick_holder()
        path = os.path.join(self.out, "clients", f"{c.name}.clock")

        def set_offset(off):
            with open(path + ".tmp", "w") as f:
                f.write(f"{off:.3f}")
            os.replace(path + ".tmp", path)
            c.signal(signal.SIGUSR1)

        mode = self.rng.choice(["step", "strobe"])
        length = self.rng.uniform(2.0, 4.0)
        start = mono()
        if mode == "step":
            step = -self.rng.uniform(1.5, 4.0)
            set_offset(step)
            time.sleep(length)
        else:
            step = 0.0
            while mono() - start < length:
                time.sleep(0.2)
                step -= 0.2
                set_offset(step)
        set_offset(0.0)
        self.record_fault(kind="clock-step", start=start, end=mono(), target=c.name, mode=mode,
                          step_s=round(step, 3), was_holder=held)

    def fault_gateway_kill_during_stall(self):
        d = self.rng.uniform(2.5, 4.0)
        http("POST", f"{self.ctl}/stall?seconds={d:.3f}")
        start = mono()
        time.sleep(self.rng.uniform(0.3, 0.8))  # the gateway forwards requests into the stall
        st, stats = http("GET", f"{self.ctl}/stats", timeout=1)
        inflight = stats.get("inflight") if st == 200 and isinstance(stats, dict) else None
        self.gateway.kill9()
        time.sleep(0.2)
        self.gateway.start()
        self.wait_gateway()
        time.sleep(max(0.0, start + d - mono()))
        self.record_fault(kind="gateway-kill-during-stall", start=start, end=mono(), stall_s=round(d, 3),
                          upstream_inflight_at_kill=inflight, pid=self.gateway.pid)

    def free_resources(self):
        """The resources nobody holds right now (from the status API)."""
        free = []
        for k in range(self.args.resources):
            st, body = http("GET", f"{self.api}/v1/locks/status?key=res/{k}", timeout=1)
            if st == 200 and isinstance(body, dict) and not body.get("held"):
                free.append(k)
        return free

    def recorder_stats(self):
        st, stats = http("GET", f"{self.ctl}/stats", timeout=1)
        return stats if st == 200 and isinstance(stats, dict) else {}

    def grant_free_resource(self, holder, kind, start):
        """A grant for `holder` on a resource nobody holds, tried for up to
        8 s (a loaded machine queues it behind the workload); (key, token,
        lease_id), token None (and the fault recorded as skipped) if none
        came."""
        token = lease = key = None
        while token is None and mono() - start < 8.0:
            free = self.free_resources()
            key = f"res/{self.rng.choice(free or range(self.args.resources))}"
            token, lease = holder.acquire(key, ttl=3000, wait=1000)
        if token is None:
            self.record_fault(kind=kind, start=start, end=mono(), key=key, skipped="no grant within 8 s")
        return key, token, lease

    def fault_gateway_stop_during_stall(self):
        """A clean stop while an old holder's write is still in flight
        (issue 19). The harness, as the recorded holder "nz", acquires a
        resource, reads it and sends a write derived from it that the
        recorder holds (below), on the gateway's general path; once the
        recorder holds it, nz gives up (closes the connection, no answer).
        Then SIGTERM: a gateway that counts only connections finds nothing
        of nz's to drain and records a clean stop. It is restarted at once,
        nz releases, and the harness, as "nn", acquires the resource, reads
        and writes it; only then is the held write let go.

        The recorder holds the write until that moment, or HOLD_S after its
        arrival, whichever comes first; HOLD_S stays below the route's
        upstream_timeout_ms (the README's rule for a backend). A gateway
        whose stop waits for the write cannot restart before the hold ends:
        the write is applied before the stop completes, and nothing later
        can be superseded by it. One that does not wait restarts without a
        quarantine, nn (or a workload client) is granted while the write is
        still held, and it lands after that grant (superseded-applied) and
        after nn's write (non-monotonic, lost-update)."""
        if self.zombie is None:
            self.zombie = RecordedHolder("nz", self.out, self.api, self.proxy)
            self.successor = RecordedHolder("nn", self.out, self.api, self.proxy)
        z, nn = self.zombie, self.successor
        kind = "gateway-stop-during-stall"
        hold = UPSTREAM_TIMEOUT_MS / 1000 - 0.5
        z.reconnect()
        nn.reconnect()
        start = mono()
        key, token, lease = self.grant_free_resource(z, kind, start)
        if token is None:
            return
        ok, prev, n = z.read(key, token)
        if not ok:
            z.release(key, token, lease)
            self.record_fault(kind=kind, start=start, end=mono(), key=key, token=token, skipped="read failed")
            return
        before = self.recorder_stats().get("held_total", 0)
        sent = mono()
        held, _ = z.send_abandoned_write(key, token, prev, n, int(hold * 1000),
                                         lambda: self.recorder_stats().get("held_total", 0) > before, 1.0)
        t_stop = mono()
        code = self.gateway.stop(grace=15)
        stop_s = mono() - t_stop
        # 0: the stop waited for the held write (applied meanwhile); 1: it did not
        held_after_stop = self.recorder_stats().get("held")
        if code != 0:
            self.unexpected.append({"process": "gateway", "code": code, "at": mono(), "when": f"SIGTERM ({kind})"})
        self.gateway.start()
        end = mono()
        ready = self.wait_gateway()
        z.reconnect()
        nn.reconnect()
        rel = z.release(key, token, lease)
        # A newer holder at once: its grant, read and write, then the held
        # write goes on (if it is still held: the stop did not wait for it).
        ntok, nlease = nn.acquire(key, ttl=1000, wait=1000)
        nst = None
        if ntok is not None:
            ok, p2, n2 = nn.read(key, ntok)
            if ok:
                nst, _ = nn.write(key, ntok, p2, n2)
            nn.release(key, ntok, nlease)
        http("POST", f"{self.ctl}/unhold", timeout=1)
        while mono() < sent + hold + 1.0 and self.recorder_stats().get("held", 0) > 0:
            time.sleep(0.02)
        self.record_fault(kind=kind, start=start, end=end, key=key, token=token, hold_s=round(hold, 3),
                          held_when_given_up=held, stop_s=round(stop_s, 3), gateway_exit=code,
                          held_after_stop=held_after_stop, ready_after_s=round(ready - end, 3), release_st=rel,
                          successor_token=ntok, successor_write_st=nst, pid=self.gateway.pid)

    def fault_holder_retry(self):
        """Same-holder ordering (issue 17, X-Fencing-Sequence). The harness,
        as the recorded holder "nr", acquires a resource nobody holds (TTL
        3 s), reads it and numbers its writes 1, 2, 3 under that grant:

        1. write 1, derived from the read;
        2. write 2, derived from write 1, which the recorder holds HOLD_S
           from its arrival (below the route's upstream_timeout_ms, the
           longest a higher sequence waits for it); once held, nr gives up
           on it (closes the connection, no answer);
        3. write 3, derived from write 2, on a new connection: the gateway
           orders it after write 2 still in flight (it waits for it);
        4. write 2 again, the very same request on a new connection (a
           retry layer that did not see write 3 go): refused with 409
           stale_sequence, never forwarded.

        A gateway that ignores the header (shadow mode forwards the retry)
        lets write 2 land again after write 3: sequence-order (and
        lost-update); one that does not wait lets write 3 land before the
        held write 2: sequence-order too."""
        if self.retrier is None:
            self.retrier = RecordedHolder("nr", self.out, self.api, self.proxy)
        r = self.retrier
        kind = "holder-retry"
        hold = UPSTREAM_TIMEOUT_MS / 2000
        r.reconnect()
        start = mono()
        key, token, lease = self.grant_free_resource(r, kind, start)
        if token is None:
            return
        ok, prev, n = r.read(key, token)
        st1 = st3 = retry = code3 = retry_code = None
        held = False
        waited = None
        if ok:
            st1, _ = r.write(key, token, prev, n, sequence=1)
        if st1 == 200:
            op1 = f"{r.id}:{r.nops}"
            before = self.recorder_stats().get("held_total", 0)
            held, (op2, value2) = r.send_abandoned_write(
                key, token, op1, n + 1, int(hold * 1000),
                lambda: self.recorder_stats().get("held_total", 0) > before, 1.0, sequence=2)
            if held:
                t3 = mono()
                st3, code3 = r.write(key, token, op2, n + 2, sequence=3, fresh=True)
                waited = round(mono() - t3, 3)
                retry, retry_code = r.write(key, token, op1, n + 1, sequence=2, op_value=(op2, value2), fresh=True)
        rel = r.release(key, token, lease)
        http("POST", f"{self.ctl}/unhold", timeout=1)
        until = mono() + hold + 1.0
        while mono() < until and self.recorder_stats().get("held", 0) > 0:
            time.sleep(0.02)
        self.record_fault(kind=kind, start=start, end=mono(), key=key, token=token, hold_s=round(hold, 3),
                          write1_st=st1, held_when_given_up=held, write3_st=st3, write3_code=code3,
                          write3_took_s=waited, retry_st=retry, retry_code=retry_code, release_st=rel)

    def check_processes(self):
        for p in [self.gateway, self.recorder]:
            if not p.alive():
                code = p.p.returncode
                self.unexpected.append({"process": p.name, "code": code, "at": mono()})
                log(f"!! {p.name} exited unexpectedly with {code}; restarting it")
                p.start()
                (self.wait_gateway if p is self.gateway else self.wait_recorder)()
        for c in self.clients:
            if not c.alive() and mono() < self.stop_at - 1:
                self.unexpected.append({"process": c.name, "code": c.p.returncode, "at": mono()})
                log(f"!! client {c.name} exited early with {c.p.returncode}")
                c.p = None  # report once

    def run_nemesis(self):
        kinds = [k for k in self.args.faults.split(",") if k]
        fns = {k: getattr(self, "fault_" + k.replace("-", "_")) for k in kinds}
        # The longest fault lasts at most about this long (gateway-stop-during-stall:
        # up to 3 s for its grant, 1 s to see its write held, a stop that waits
        # out the hold, a restart, a successor's grant, read and write).
        longest = getattr(self, "longest_fault_s", 8.0)
        first = [k for k in (self.args.first_faults or "").split(",") if k]
        queue = list(reversed(first))  # these run first, in order, then the shuffled rounds
        time.sleep(min(self.args.warmup, max(0.0, self.stop_at - mono())))
        while mono() + longest + self.bound + 1.0 < self.stop_at:
            self.check_processes()
            if not queue:
                queue = list(kinds)
                self.rng.shuffle(queue)
            kind = queue.pop()
            (fns.get(kind) or getattr(self, "fault_" + kind.replace("-", "_")))()
            self.check_processes()
            if self.args.quiet_gap is None:
                gap = self.bound + self.rng.uniform(0.5, 2.0)  # quiet: liveness is judged here
            else:
                gap = self.args.quiet_gap + self.rng.uniform(0.0, 1.0)
            time.sleep(max(0.0, min(gap, self.stop_at - mono())))
        while mono() < self.stop_at:
            self.check_processes()
            time.sleep(min(1.0, max(0.0, self.stop_at - mono())))

    # -- the end
    def finish(self):
        deadline = self.stop_at + 30
        for c in self.clients:
            if c.p is None:
                continue
            try:
                c.p.wait(timeout=max(0.1, deadline - mono()))
            except subprocess.TimeoutExpired:
                log(f"client {c.name} still running 30 s after the end; stopping it")
                c.stop(grace=5)
            if c.p.returncode not in (0, None):
                self.unexpected.append({"process": c.name, "code": c.p.returncode, "at": mono()})
        st, metrics = http("GET", self.api + "/metrics", timeout=3)
        if st == 200:
            with open(os.path.join(self.out, "gateway-metrics-final.txt"), "w") as f:
                f.write(metrics if isinstance(metrics, str) else json.dumps(metrics))
        code = self.gateway.stop(grace=15)
        if code not in (0, None):
            self.unexpected.append({"process": "gateway", "code": code, "at": mono(), "when": "graceful stop"})
        self.recorder.stop(grace=5)
        self.write_run()

    def cleanup(self):
        if self.cleaned:
            return
        self.cleaned = True
        for c in self.clients:
            if c.p is not None:
                c.signal(signal.SIGCONT)
        if self.net is not None:
            try:
                self.net.heal()
            except (OSError, RuntimeError, subprocess.SubprocessError):
                pass
        for c in self.clients:
            if c.p is not None and c.alive():
                c.kill9()
        for p in (self.gateway, self.recorder):
            if p is not None and p.alive():
                p.stop(grace=5)
        if self.net is not None:
            self.net.teardown()
        for holder in (self.zombie, self.successor, self.retrier):
            if holder is not None:
                holder.close()
        if self.faults_file is not None:
            self.faults_file.close()


def main():
    ap = argparse.ArgumentParser(description="Nemesis harness for fencegate: faults, histories, checker.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--duration", type=float, default=90, help="seconds of workload (default 90)")
    ap.add_argument("--clients", type=int, default=6, help="workload clients, at least 5 (default 6)")
    ap.add_argument("--resources", type=int, default=3, help="resources (locks) shared by the clients")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    ap.add_argument("--unfenced", action="store_true",
                    help="self-test: the route runs in shadow mode (enforce = false); succeed only if the "
                         "checker finds safety anomalies")
    ap.add_argument("--binary", default=os.environ.get("FENCEGATE_BIN",
                                                       os.path.join(os.path.dirname(HERE), "target", "debug",
                                                                    "fencegate")))
    ap.add_argument("--out", help="run directory (default: a new temporary directory)")
    ap.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                    help=f"comma list from {','.join(ALL_FAULTS)}, or 'all' (the default: all of them)")
    ap.add_argument("--first-faults", default="",
                    help="comma list of faults run first, in this order, before the shuffled rounds (CI: "
                         "a fault the run must exercise whatever the seed)")
    ap.add_argument("--partition", choices=["auto", "netns", "proxy"], default="auto",
                    help="how to cut c0 off: network namespaces if possible (auto), or the loopback TCP proxy")
    ap.add_argument("--ttl-min", type=int, default=300, help="shortest lease a client asks for, ms")
    ap.add_argument("--ttl-max", type=int, default=1000, help="longest lease a client asks for, ms")
    ap.add_argument("--liveness-slack", type=float, default=3.0,
                    help="liveness bound = TTL max + the route's upstream timeout + this, s")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the first fault")
    ap.add_argument("--quiet-gap", type=float, default=None,
                    help="seconds between faults (default: the liveness bound + 0.5-2 s; shorter gaps leave "
                         "the liveness of the faults they cut short unjudged)")
    ap.add_argument("--upstream-request-timeout", type=float, default=2.0,
                    help="the recorder applies a request within this many seconds or not at all")
    ap.add_argument("--gateway-log-level", default="warn")
    ap.add_argument("--s3", action="store_true",
                    help="S3 mode (s3mode.py): s3s-fs behind an S3 route, boto3 clients, s3checker.py; faults "
                         "default to the S3 mode's (pause, gateway-kill, gateway-pause, gateway-restart, "
                         "upstream-kill, partition)")
    ap.add_argument("--s3s-fs", default=None, help="S3 mode: the s3s-fs binary (default $S3S_FS, "
                                                    "~/.cargo/bin/s3s-fs, or PATH)")
    ap.add_argument("--python", default=os.path.join(os.path.dirname(HERE), ".venv", "bin", "python"),
                    help="S3 mode: the python with boto3 that runs the clients (default: the repository's .venv "
                         "made by scripts/setup-s3.sh)")
    a = ap.parse_args()
    known = ALL_FAULTS
    if a.s3:
        import s3mode  # noqa: E402  (only the S3 mode needs it)
        known = s3mode.S3_FAULTS
        if a.faults == ",".join(DEFAULT_FAULTS):
            a.faults = ",".join(s3mode.S3_FAULTS)
        a.s3s_fs = a.s3s_fs or s3mode.s3s_fs_binary()
    if a.faults == "all":
        a.faults = ",".join(known)
    bad = [k for k in (a.faults + "," + a.first_faults).split(",") if k and k not in known]
    if bad:
        ap.error(f"unknown fault(s) {bad}; known: {known}")
    if a.clients < 5:
        ap.error("--clients must be at least 5")
    if not 0 < a.upstream_request_timeout < UPSTREAM_TIMEOUT_MS / 1000:
        ap.error(f"--upstream-request-timeout must stay below the route's upstream_timeout_ms ({UPSTREAM_TIMEOUT_MS} ms)")
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 1 << 31)
    if not os.access(a.binary, os.X_OK):
        print(f"no gateway binary at {a.binary}: run `cargo build --bin fencegate` or pass --binary", file=sys.stderr)
        return 2
    a.out = os.path.abspath(a.out or tempfile.mkdtemp(prefix="fencegate-nemesis-"))
    os.makedirs(a.out, exist_ok=True)
    log(f"fencegate nemesis run: out={a.out} seed={a.seed} duration={a.duration}s "
        f"mode={'unfenced self-test' if a.unfenced else 'fenced'}{' s3' if a.s3 else ''}")

    h = s3mode.S3Harness(a) if a.s3 else Harness(a)
    check = checker
    if a.s3:
        import s3checker as check  # noqa: E402
    atexit.register(h.cleanup)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # A watchdog: the whole run is bounded even if something hangs.
    signal.signal(signal.SIGALRM, on_signal)
    signal.alarm(int(a.duration + 240))
    try:
        h.start()
        h.run_nemesis()
        log("workload over; waiting for the clients to finish")
        h.finish()
    except (KeyboardInterrupt, RuntimeError, OSError) as e:
        log(f"harness failed: {e!r}")
        h.cleanup()
        return 2
    finally:
        h.cleanup()
        signal.alarm(0)
    s = check.check(a.out)
    text = check.render(s)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    print(f"histories and logs: {a.out}")
    if s.get("error"):
        return 2
    if a.unfenced:
        if s["safety_anomalies"] > 0:
            print(f"SELF-TEST PASSED: the checker caught the unfenced gateway "
                  f"({s['safety_anomalies']} safety anomalies)")
            return 0
        print("SELF-TEST FAILED: the unfenced gateway let zombie writes through, yet the checker found nothing")
        return 1
    if s["anomalies"]:
        print(f"FAILED: {s['anomalies']} anomalies")
        return 1
    print("OK: no anomalies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
