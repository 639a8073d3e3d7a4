#!/usr/bin/env python3
"""Cluster-mode nemesis harness for fencegate (standard library only).

The same recording upstream, workload clients and checker as
``harness.py``, in front of a real cluster: a 3-member etcd cluster and 3
gateways in cluster mode sharing it. Each client acquires on one gateway
and reads and writes through the next one (client i: lease API of gateway
i mod 3, proxy of gateway i+1 mod 3), so every grant is fenced across
gateways. Faults, one at a time:

  etcd-leader-kill    kill -9 the etcd leader, restart it 1-3 s later
  etcd-leader-stop    SIGSTOP the etcd leader 2-4 s (> the 1 s election
                      timeout), then SIGCONT
  etcd-follower-kill  kill -9 one etcd follower, restart it 2-5 s later
  etcd-follower-stop  SIGSTOP one etcd follower 8-12 s (a hung member: its
                      connections stay open, nothing is answered), one a
                      gateway sends its etcd requests to: when they all
                      send to the leader (they prefer it), leadership is
                      moved away first (etcdctl move-leader) and the old
                      leader, still in use, is stopped; the probe's grant
                      should come while it is stopped
  gateway-stop        SIGSTOP a gateway with a holder's write in flight (the
                      upstream holds it), longer than its member TTL: the
                      holder's next write waits in the stopped gateway, the
                      holder releases, a successor is granted through another
                      gateway and writes; then SIGCONT (the waiting write
                      must be refused)
  gateway-kill        kill -9 a gateway with a holder's write in flight (the
                      upstream holds it), restart it; that holder's key is
                      taken over through another gateway
  gateway-partition   gateway 3 cut from etcd (it keeps its clients and its
                      upstream): a holder reads through it, the cut, the
                      holder releases, a successor is granted through
                      gateway 1 and writes, then the holder writes through
                      gateway 3 with its old token (it must be refused)
  etcd-compact        ``etcdctl compact`` at etcd's current revision under load
  pause               SIGSTOP a lease holder (client) past its TTL

The etcd faults and gateway-kill also measure availability: a probe holder
acquires a fresh key through one gateway and writes it through another
from the fault's start, and the fault's record says when the first grant
(``next_grant_s``) and the first acknowledged fenced write
(``next_write_s``) came.

Partition of gateway 3 from etcd: with network namespaces (root, iproute2)
gateway 3 runs alone in namespace C, joined to G (everything else) by two
veth pairs: one for its clients and its upstream, one for etcd only; the
cut sets G's end of the etcd pair down (packets dropped). Otherwise
gateway 3 reaches etcd through loopback TCP proxies of the harness that
stall every byte and every new connection while cut.

Self-test: ``--broken no-self-fencing`` starts the gateways with the fault
of ``src/fault.rs`` injected (debug builds only): they keep admitting past
their member deadline. The run passes only if the checker finds safety
anomalies.

    python3 nemesis/cluster.py --duration 60
    python3 nemesis/cluster.py --broken no-self-fencing --faults gateway-partition --duration 40
    python3 nemesis/cluster.py --duration 600 --seed 20261201 --out /tmp/fencegate-cluster-soak
"""
import argparse
import atexit
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checker  # noqa: E402
import harness as hz  # noqa: E402
import itertools  # noqa: E402
from harness import CutProxy, Proc, free_port, http, log, mono, setns  # noqa: E402

FAULTS = ["etcd-leader-kill", "etcd-leader-stop", "etcd-follower-kill", "etcd-follower-stop", "gateway-stop",
          "gateway-kill", "gateway-partition", "etcd-compact", "pause"]
UPSTREAM_TIMEOUT_MS = hz.UPSTREAM_TIMEOUT_MS
# A gateway that vanished without draining holds grants back this long after
# its membership ended (docs/cluster.md): the longest upstream timeout + 0.5 s.
QUARANTINE_S = UPSTREAM_TIMEOUT_MS / 1000 + 0.5
# etcd's floor for a lease TTL on its default 1 s election timeout.
ETCD_MIN_TTL_S = 2.0


class LoopNet:
    """Everything on loopback; gateway 3 reaches etcd through cut proxies."""

    method = "tcp-proxy"
    data_host = "127.0.0.1"  # recorder, gateways 1-2
    gw3_host = "127.0.0.1"

    def __init__(self):
        self.healed = threading.Event()
        self.healed.set()
        self.proxies = []

    def setup(self):
        pass

    def etcd_listen(self, port):
        return [f"http://127.0.0.1:{port}"]

    def gw3_etcd(self, port):
        p = CutProxy(f"http://127.0.0.1:{port}", self.healed)
        self.proxies.append(p)
        return f"http://127.0.0.1:{p.port}"

    def wrap_gw3(self, argv):
        return argv

    def cut(self):
        self.healed.clear()

    def heal(self):
        self.healed.set()

    def teardown(self):
        self.heal()
        for p in self.proxies:
            p.close()


class NetnsNet:
    """Namespaces G (harness, etcd, recorder, gateways 1-2, clients) and C
    (gateway 3). Data pair gd/cd: 10.213.0.1 (G) - 10.213.0.2 (C); etcd
    pair ge/ce: 10.213.0.5 (G) - 10.213.0.6 (C). etcd listens on loopback
    and on 10.213.0.5, gateway 3 uses the latter only; the recorder listens
    on 10.213.0.1. A cut sets ge down: gateway 3 loses etcd, nothing else."""

    method = "netns"
    data_host = "10.213.0.1"
    gw3_host = "10.213.0.2"
    etcd_host = "10.213.0.5"

    def __init__(self):
        tag = f"fgc{os.getpid()}"
        self.g, self.c = tag + "g", tag + "c"
        self.created = []
        self.root_fd = None

    ip = staticmethod(hz.NetnsNet.ip)

    @staticmethod
    def reap_stale():
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
        for line in r.stdout.splitlines():
            m = re.match(r"^(fgc(\d+)[gc])\b", line)
            if m and not os.path.exists(f"/proc/{m.group(2)}"):
                subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True, timeout=10)

    def setup(self):
        if shutil.which("ip") is None:
            raise RuntimeError("iproute2 (ip) not installed")
        self.reap_stale()
        g, c = self.g, self.c
        for ns in (g, c):
            self.ip("netns", "add", ns)
            self.created.append(ns)
        self.ip("-n", g, "link", "add", "gd", "type", "veth", "peer", "name", "cd", "netns", c)
        self.ip("-n", g, "link", "add", "ge", "type", "veth", "peer", "name", "ce", "netns", c)
        self.ip("-n", g, "addr", "add", "10.213.0.1/30", "dev", "gd")
        self.ip("-n", c, "addr", "add", "10.213.0.2/30", "dev", "cd")
        self.ip("-n", g, "addr", "add", "10.213.0.5/30", "dev", "ge")
        self.ip("-n", c, "addr", "add", "10.213.0.6/30", "dev", "ce")
        for ns, dev in ((g, "lo"), (c, "lo"), (g, "gd"), (c, "cd"), (g, "ge"), (c, "ce")):
            self.ip("-n", ns, "link", "set", dev, "up")
        self.root_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{g}", os.O_RDONLY)
        try:
            setns(fd)
        finally:
            os.close(fd)
        self._self_test()

    def _probe(self, host, port, timeout):
        code = f"import socket; socket.create_connection(('{host}', {port}), timeout={timeout}).close()"
        r = subprocess.run(["ip", "netns", "exec", self.c, sys.executable, "-c", code], capture_output=True,
                           timeout=timeout + 10)
        return r.returncode == 0

    def _self_test(self):
        """C reaches G on both pairs; a cut stops the etcd pair only."""
        socks = []
        try:
            ports = {}
            for host in (self.data_host, self.etcd_host):
                s = socket.socket()
                s.bind((host, 0))
                s.listen(8)
                socks.append(s)
                ports[host] = s.getsockname()[1]
            for host, port in ports.items():
                if not self._probe(host, port, 2):
                    raise RuntimeError(f"namespace C cannot reach {host}")
            self.cut()
            try:
                if self._probe(self.etcd_host, ports[self.etcd_host], 0.5):
                    raise RuntimeError("a cut etcd pair still carried a connection")
                if not self._probe(self.data_host, ports[self.data_host], 2):
                    raise RuntimeError("the cut of the etcd pair also cut the data pair")
            finally:
                self.heal()
            deadline = mono() + 5
            while not self._probe(self.etcd_host, ports[self.etcd_host], 1):
                if mono() > deadline:
                    raise RuntimeError("the etcd pair did not come back after heal")
        finally:
            for s in socks:
                s.close()

    def etcd_listen(self, port):
        return [f"http://127.0.0.1:{port}", f"http://{self.etcd_host}:{port}"]

    def gw3_etcd(self, port):
        return f"http://{self.etcd_host}:{port}"

    def wrap_gw3(self, argv):
        return ["ip", "netns", "exec", self.c, *argv]

    def cut(self):
        self.ip("-n", self.g, "link", "set", "ge", "down")

    def heal(self):
        self.ip("-n", self.g, "link", "set", "ge", "up")

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


class Member:
    """One etcd member: a process, its client URL (loopback) and its id."""

    def __init__(self, name, proc, url):
        self.name, self.proc, self.url = name, proc, url

    def status(self):
        st, body = http("POST", f"{self.url}/v3/maintenance/status", {}, timeout=1)
        return body if st == 200 and isinstance(body, dict) else None


class Gw:
    """One gateway: its process and its two base URLs."""

    def __init__(self, name, proc, api, proxy):
        self.name, self.proc, self.api, self.proxy = name, proc, api, proxy


class Holder(hz.RecordedHolder):
    """A recorded holder whose write can wait longer (into a stopped
    gateway), and whose record takes lines from two threads."""

    def __init__(self, *a):
        super().__init__(*a)
        self.lock = threading.Lock()

    def record(self, **kv):
        with self.lock:
            super().record(**kv)

    # One numbering of ops for every Holder of a run: holders of one id are
    # made afresh per fault, and an op id must name one write.
    OPS = itertools.count(1)

    def value(self, prev, n, token):
        op = f"{self.id}:{next(Holder.OPS)}"
        return op, json.dumps({"op": op, "prev": prev, "n": n + 1, "by": self.id, "tok": token},
                              separators=(",", ":"))

    def write(self, key, token, prev, n, sequence=None, op_value=None, fresh=False, timeout=10):
        op, value = op_value or self.value(prev, n, token)
        headers = {"X-Fencing-Token": str(token), "Content-Type": "application/json"}
        if fresh:
            self.proxy.close()
        t0 = mono()
        st, data, err = self.proxy.request("PUT", "/" + key, value.encode(), headers, timeout=timeout)
        code = hz.wl.error_code(data) if st is not None and st >= 300 else None
        self.record(ev="write", key=key, token=token, t0=t0, t1=mono(), st=st, err=err, code=code, op=op, prev=prev,
                    value=value)
        return st, code


class ClusterHarness(hz.Harness):
    def __init__(self, args):
        super().__init__(args)
        self.member_ttl_s = args.member_ttl_ms / 1000
        # Liveness bound: a lease left behind lasts its TTL (etcd's floor is
        # 2 s); a gateway that died or was cut holds every grant back until
        # its membership lease expired plus the quarantine; plus the slack.
        self.bound = (max(self.ttl_max / 1000, ETCD_MIN_TTL_S) + self.member_ttl_s + QUARANTINE_S
                      + args.liveness_slack)
        self.members, self.gws = [], []
        self.keys = itertools.count(1)

    # -- setup
    def choose_net(self):
        if self.args.partition in ("auto", "netns"):
            net = NetnsNet()
            try:
                net.setup()
                return net
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                net.teardown()
                if self.args.partition == "netns":
                    raise
                log(f"network namespaces unavailable ({e}); gateway 3 reaches etcd through cut TCP proxies")
        net = LoopNet()
        net.setup()
        return net

    def start(self):
        a = self.args
        if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
            raise RuntimeError("etcd and etcdctl are needed (the etcd-server and etcd-client packages)")
        os.makedirs(os.path.join(self.out, "clients"), exist_ok=True)
        for f in ("recorder.jsonl", "nemesis.jsonl"):
            if os.path.exists(os.path.join(self.out, f)):
                raise RuntimeError(f"{self.out} already holds a run; use a fresh --out")
        self.net = self.choose_net()
        log(f"partition method: {self.net.method}")
        py = sys.executable
        # etcd: 3 members, default timings (heartbeat 100 ms, election 1 s)
        cports = [free_port("127.0.0.1") for _ in range(3)]
        pports = [free_port("127.0.0.1") for _ in range(3)]
        initial = ",".join(f"e{i}=http://127.0.0.1:{pports[i]}" for i in range(3))
        for i in range(3):
            argv = ["etcd", "--name", f"e{i}", "--data-dir", os.path.join(self.out, "etcd", f"e{i}"),
                    "--listen-client-urls", ",".join(self.net.etcd_listen(cports[i])),
                    "--advertise-client-urls", f"http://127.0.0.1:{cports[i]}",
                    "--listen-peer-urls", f"http://127.0.0.1:{pports[i]}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{pports[i]}",
                    "--initial-cluster", initial, "--initial-cluster-state", "new",
                    "--initial-cluster-token", f"fg-nemesis-{os.getpid()}"]
            p = Proc(f"etcd-e{i}", argv, os.path.join(self.out, f"etcd-e{i}.log"))
            p.start()
            self.members.append(Member(f"e{i}", p, f"http://127.0.0.1:{cports[i]}"))
        self.wait_etcd()
        # the recorder, reachable from both namespaces
        rport, cport = free_port(self.net.data_host), free_port(self.net.data_host)
        self.ctl = f"http://{self.net.data_host}:{cport}"
        self.recorder = Proc("recorder", [py, os.path.join(HERE, "recorder.py"), "--host", self.net.data_host,
                                          "--port", str(rport), "--control-port", str(cport), "--log",
                                          os.path.join(self.out, "recorder.jsonl"),
                                          "--request-timeout", str(a.upstream_request_timeout)],
                             os.path.join(self.out, "recorder.log"))
        self.recorder.start()
        self.wait_recorder()
        # the gateways
        for i in range(3):
            host = self.net.gw3_host if i == 2 else "127.0.0.1"
            # Gateway 3's address may live in namespace C, where nothing
            # else listens: a port free on loopback here is free there.
            pport, aport = free_port("127.0.0.1"), free_port("127.0.0.1")
            eps = [self.net.gw3_etcd(p) for p in cports] if i == 2 else [f"http://127.0.0.1:{p}" for p in cports]
            conf = os.path.join(self.out, f"gw{i + 1}.toml")
            with open(conf, "w") as f:
                f.write(f"""# written by nemesis/cluster.py ({'BROKEN on purpose: ' + a.broken if a.broken else 'fenced'})
data_dir = "{os.path.join(self.out, f'gw{i + 1}-data')}"
listen = "{host}:{pport}"
api_listen = "{host}:{aport}"
log_level = "{a.gateway_log_level}"

[cluster]
etcd_endpoints = [{", ".join(json.dumps(e) for e in eps)}]
gateway_id = "gw{i + 1}"
member_ttl_ms = {a.member_ttl_ms}

[locks]
# Longer than a dead member's TTL + its quarantine: a grant waits them out.
activation_timeout_ms = {int(1000 * (self.member_ttl_s + QUARANTINE_S)) + 10000}

[[routes]]
name = "nemesis"
match = "/{{*path}}"
upstream = "http://{self.net.data_host}:{rport}"
enforce = true
upstream_timeout_ms = {UPSTREAM_TIMEOUT_MS}
connect_timeout_ms = 1000
""")
            r = subprocess.run([a.binary, "check-config", conf], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"gateway config refused: {r.stdout}{r.stderr}")
            argv = [a.binary, "serve", "--config", conf]
            if a.broken:
                argv = ["env", f"FENCEGATE_NEMESIS_BREAK={a.broken}", *argv]
            if i == 2:
                argv = self.net.wrap_gw3(argv)
            p = Proc(f"gw{i + 1}", argv, os.path.join(self.out, f"gw{i + 1}.log"))
            p.start()
            self.gws.append(Gw(f"gw{i + 1}", p, f"http://{host}:{aport}", f"http://{host}:{pport}"))
        for g in self.gws:
            self.wait_current(g)
        self.gateway = self.gws[0].proc  # the base class's status helpers use gateway 1
        self.api, self.proxy = self.gws[0].api, self.gws[0].proxy
        self.t0 = mono()
        self.stop_at = self.t0 + a.duration
        self.faults_file = open(os.path.join(self.out, "nemesis.jsonl"), "a", buffering=1)
        for i in range(a.clients):
            name = f"c{i}"
            api, proxy = self.gws[i % 3].api, self.gws[(i + 1) % 3].proxy
            argv = [py, os.path.join(HERE, "client.py"), "--id", name, "--api", api, "--proxy", proxy,
                    "--resources", ",".join(f"res/{k}" for k in range(a.resources)),
                    "--ttl-min", str(self.ttl_min), "--ttl-max", str(self.ttl_max),
                    "--record", os.path.join(self.out, "clients", f"{name}.jsonl"),
                    "--stop-at", f"{self.stop_at:.3f}", "--seed", str(a.seed * 1000 + i),
                    "--clock-file", os.path.join(self.out, "clients", f"{name}.clock")]
            p = Proc(name, argv, os.path.join(self.out, "clients", f"{name}.log"))
            p.start()
            self.clients.append(p)
        self.run_info = {
            "mode": f"cluster-broken-{a.broken}" if a.broken else "cluster", "partition_method": self.net.method,
            "clients": a.clients, "resources": a.resources, "seed": a.seed, "duration_s": a.duration,
            "ttl_min_ms": self.ttl_min, "ttl_max_ms": self.ttl_max, "member_ttl_ms": a.member_ttl_ms,
            "liveness_bound_s": self.bound, "start": self.t0, "stop_at": self.stop_at,
            "faults_enabled": a.faults, "first_faults": a.first_faults, "binary": a.binary,
            "gateways": {g.name: {"api": g.api, "proxy": g.proxy} for g in self.gws},
            "etcd": {m.name: m.url for m in self.members},
            "upstream_request_timeout_s": a.upstream_request_timeout, "argv": sys.argv,
        }
        self.write_run()
        log(f"{a.clients} clients on {a.resources} resources across 3 gateways and 3 etcd members, "
            f"member TTL {a.member_ttl_ms} ms, liveness bound {self.bound:.1f} s"
            + (f", gateways BROKEN on purpose ({a.broken})" if a.broken else ""))

    def wait_etcd(self, timeout=30):
        deadline = mono() + timeout
        while mono() < deadline:
            if self.leader() is not None:
                return
            time.sleep(0.1)
        raise RuntimeError("the etcd cluster elected no leader (see etcd-e*.log)")

    def wait_ready(self, g, timeout=30):
        deadline = mono() + timeout
        while mono() < deadline:
            st, _ = http("GET", g.api + "/readyz", timeout=1)
            if st == 200:
                return mono()
            if not g.proc.alive():
                raise RuntimeError(f"{g.name} exited with {g.proc.p.returncode} (see {g.name}.log)")
            time.sleep(0.02)
        raise RuntimeError(f"{g.name} did not become ready (see {g.name}.log)")

    def wait_current(self, g, timeout=30):
        """Ready, joined and current (fencegate_cluster_current 1)."""
        self.wait_ready(g, timeout)
        deadline = mono() + timeout
        while mono() < deadline:
            st, text = http("GET", g.api + "/metrics", timeout=1)
            if st == 200 and isinstance(text, str) and re.search(r"^fencegate_cluster_current 1$", text, re.M):
                return mono()
            time.sleep(0.05)
        raise RuntimeError(f"{g.name} did not become current (see {g.name}.log)")

    def leader(self):
        """Index of the etcd leader, or None."""
        ids, leader = {}, None
        for i, m in enumerate(self.members):
            if not m.proc.alive():
                continue
            s = m.status()
            if s is None:
                continue
            ids[str(s.get("header", {}).get("member_id"))] = i
            leader = leader or s.get("leader")
        return ids.get(str(leader)) if leader else None

    # -- probes
    def probe(self, start, api_gw, proxy_gw, result, key=None, wait=0, limit=40.0, cid="np"):
        """From `start`: a grant through `api_gw` on a key of its own (or
        `key`), then a fenced write through `proxy_gw`; records when each
        first succeeded (s after start) into `result`."""
        h = Holder(cid, self.out, api_gw.api, proxy_gw.proxy)
        try:
            token = lease = None
            while mono() - start < limit:
                k = key or f"probe/{next(self.keys)}"
                token, lease = h.acquire(k, ttl=2000, wait=wait)
                if token is not None:
                    result["next_grant_s"] = round(mono() - start, 3)
                    break
                time.sleep(0.05)
            if token is None:
                return
            ok, prev, n = False, None, 0
            while not ok and mono() - start < limit:
                ok, prev, n = h.read(k, token)
            while ok and mono() - start < limit:
                st, code = h.write(k, token, prev, n)
                if st == 200:
                    result["next_write_s"] = round(mono() - start, 3)
                    break
                if st is None or st < 500:
                    result["write_failed"] = f"{st} {code}"  # maybe applied, or lost: no retry
                    break
                time.sleep(0.05)
            h.release(k, token, lease)
        finally:
            h.close()

    def grant_own_key(self, holder, kind, start, limit=10.0):
        """A grant for `holder` on a key of the fault's own (`zombie/N`:
        the workload's FIFO queues on its few resources would make the
        fault wait, or skip it), tried for up to `limit` s (right after an
        etcd fault a grant waits a quarantine: docs/cluster.md)."""
        token = lease = key = None
        while token is None and mono() - start < limit:
            key = f"zombie/{next(self.keys)}"
            token, lease = holder.acquire(key, ttl=3000, wait=0)
            if token is None:
                time.sleep(0.1)
        if token is None:
            self.record_fault(kind=kind, start=start, end=mono(), key=key, skipped=f"no grant within {limit:.0f} s")
        return key, token, lease

    def start_probe(self, start, api_gw, proxy_gw, **kw):
        result = {}
        t = threading.Thread(target=self.probe, args=(start, api_gw, proxy_gw, result), kwargs=kw, daemon=True)
        t.start()
        return t, result

    def others(self, g):
        return [x for x in self.gws if x is not g]

    # -- etcd faults
    def fault_etcd_leader_kill(self):
        self.etcd_kill("etcd-leader-kill", leader=True, down=self.rng.uniform(1.0, 3.0))

    def fault_etcd_follower_kill(self):
        self.etcd_kill("etcd-follower-kill", leader=False, down=self.rng.uniform(2.0, 5.0))

    def etcd_kill(self, kind, leader, down):
        li = self.leader()
        if li is None:
            self.record_fault(kind=kind, start=mono(), end=mono(), skipped="no etcd leader")
            return
        i = li if leader else self.rng.choice([j for j in range(3) if j != li])
        m = self.members[i]
        a, b = self.rng.sample(self.gws, 2)
        start = mono()
        m.proc.kill9()
        t, res = self.start_probe(start, a, b)
        time.sleep(down)
        new_leader = self.leader()
        m.proc.start()
        end = mono()
        t.join(45)
        self.record_fault(kind=kind, start=start, end=end, member=m.name, down_s=round(down, 3),
                          leader_after=None if new_leader is None else self.members[new_leader].name,
                          probe=f"{a.name}->{b.name}", **res)

    def fault_etcd_leader_stop(self):
        kind = "etcd-leader-stop"
        li = self.leader()
        if li is None:
            self.record_fault(kind=kind, start=mono(), end=mono(), skipped="no etcd leader")
            return
        self.pause_member(kind, self.members[li], (2.0, 4.0), leader_after=True)

    def pause_member(self, kind, m, stop_s, leader_after=False, **extra):
        """SIGSTOP etcd member `m` for a time drawn from `stop_s` while a probe grants and writes
        through two random gateways, then SIGCONT; records the fault, with
        whether the probe's grant came while the member was stopped."""
        # Drawn in this order, as before: a seed gives the run it gave.
        a, b = self.rng.sample(self.gws, 2)
        d = self.rng.uniform(*stop_s)
        start = mono()
        if m.proc.pause() is None:
            raise RuntimeError(f"etcd member {m.name} did not stop within 5 s of SIGSTOP")
        t, res = self.start_probe(start, a, b)
        time.sleep(d)
        if leader_after:
            new_leader = self.leader()
            extra["leader_after"] = None if new_leader is None else self.members[new_leader].name
        m.proc.signal(signal.SIGCONT)
        end = mono()
        t.join(45)
        self.record_fault(kind=kind, start=start, end=end, member=m.name, stopped_s=round(d, 3),
                          probe=f"{a.name}->{b.name}", granted_while_stopped=res.get("next_grant_s", d + 1) < d,
                          **extra, **res)

    def members_in_use(self):
        """The etcd client URLs the gateways send their requests to now
        (`fencegate_cluster_etcd_member`)."""
        used = set()
        for g in self.gws:
            st, body = http("GET", f"{g.api}/metrics", timeout=2)
            if st != 200 or not isinstance(body, str):
                continue
            for line in body.splitlines():
                if line.startswith('fencegate_cluster_etcd_member{endpoint="') and line.endswith("} 1"):
                    used.add(line.split('"')[1])
        return used

    def fault_etcd_follower_stop(self):
        kind = "etcd-follower-stop"
        li = self.leader()
        if li is None:
            self.record_fault(kind=kind, start=mono(), end=mono(), skipped="no etcd leader")
            return
        followers = [j for j in range(3) if j != li]
        used = self.members_in_use()
        in_use = [j for j in followers if self.members[j].url in used]
        moved = None
        if not in_use and self.members[li].url in used:
            # The gateways send to the leader (they prefer it), so no
            # follower is in use: move the leadership away. They stay on
            # the old leader, now a follower, until their next status
            # round (every half member TTL): stop it then.
            moved = self.move_leader(li)
            li2 = self.leader()
            if moved and li2 is not None:
                followers = [j for j in range(3) if j != li2]
                used = self.members_in_use()
                in_use = [j for j in followers if self.members[j].url in used]
        m = self.members[self.rng.choice(in_use or followers)]
        self.pause_member(kind, m, (8.0, 12.0), in_use=bool(in_use), moved_leader=moved)

    def move_leader(self, li):
        """Moves etcd's leadership from member `li` to another (etcdctl
        move-leader: no downtime); the new leader's name, or None."""
        j = self.rng.choice([j for j in range(3) if j != li])
        st = self.members[j].status()
        if st is None:
            return None
        hexid = format(int(st["header"]["member_id"]), "x")
        r = subprocess.run(["etcdctl", "--endpoints", self.members[li].url, "move-leader", hexid],
                           capture_output=True, text=True, timeout=15, env={**os.environ, "ETCDCTL_API": "3"})
        return self.members[j].name if r.returncode == 0 else None

    def fault_etcd_compact(self):
        kind = "etcd-compact"
        m = self.rng.choice([m for m in self.members if m.proc.alive()])
        s = m.status() or {}
        rev = s.get("header", {}).get("revision")
        start = mono()
        if rev is None:
            self.record_fault(kind=kind, start=start, end=mono(), skipped="no revision")
            return
        r = subprocess.run(["etcdctl", "--endpoints", m.url, "compact", str(rev)], capture_output=True, text=True,
                           timeout=15, env={**os.environ, "ETCDCTL_API": "3"})
        self.record_fault(kind=kind, start=start, end=mono(), member=m.name, revision=int(rev), rc=r.returncode,
                          out=(r.stdout + r.stderr).strip()[:200])

    # -- gateway faults
    def fault_gateway_kill(self):
        """kill -9 a gateway with a write in flight (the upstream holds it);
        the key granted through it just before is taken over through
        another gateway (the dead gateway's keys: grantable again within
        its member TTL + the quarantine), and a fresh key is probed."""
        kind = "gateway-kill"
        g = self.rng.choice(self.gws)
        a, b = self.others(g)
        dead_key = f"dead/{next(self.keys)}"
        k = Holder("nk", self.out, g.api, g.proxy)
        ktok, _ = k.acquire(dead_key, ttl=2000, wait=0)
        held = False
        if ktok is not None:
            # Mid-forward: a write of the key's holder that the upstream
            # holds (below the route's upstream timeout), in flight when
            # the gateway dies; the successor must be granted only after
            # it can no longer land.
            ok, prev, n = k.read(dead_key, ktok)
            if ok:
                before = self.recorder_stats().get("held_total", 0)
                held, _ = k.send_abandoned_write(dead_key, ktok, prev, n, UPSTREAM_TIMEOUT_MS - 500,
                                                 lambda: self.recorder_stats().get("held_total", 0) > before, 1.0)
        k.close()
        inflight = self.recorder_stats().get("inflight")
        start = mono()
        g.proc.kill9()
        t1, res_fresh = self.start_probe(start, a, b)
        t2, res_dead = self.start_probe(start, b, a, key=dead_key, wait=30000, cid="nd") if ktok else (None, {})
        time.sleep(self.rng.uniform(0.2, 1.5))
        g.proc.start()
        end = mono()
        try:
            ready = round(self.wait_current(g, timeout=40) - end, 3)
        except RuntimeError as e:
            ready = str(e)
        t1.join(45)
        if t2 is not None:
            t2.join(45)
        self.record_fault(kind=kind, start=start, end=end, target=g.name, upstream_inflight_at_kill=inflight,
                          held_write_in_flight=held,
                          current_after_restart_s=ready, **res_fresh,
                          dead_key_granted_s=res_dead.get("next_grant_s"), dead_key_write_s=res_dead.get("next_write_s"))

    def fault_gateway_stop(self):
        """SIGSTOP a gateway mid-forward for longer than its member TTL: a
        holder's write it forwarded is held by the upstream, the holder's
        next write waits in its socket, the holder releases, a successor is granted
        through another gateway (once the stopped one's membership expired
        and its quarantine passed) and writes; then SIGCONT: the queued
        write must be refused (not_current), never applied."""
        kind = "gateway-stop"
        g = self.rng.choice(self.gws)
        a, b = self.others(g)
        z = Holder("nz", self.out, a.api, g.proxy)
        nn = Holder("nn", self.out, a.api, b.proxy)
        start = mono()
        key, token, lease = self.grant_own_key(z, kind, start)
        if token is None:
            z.close()
            nn.close()
            return
        ok, prev, n = z.read(key, token)
        held = False
        if ok:
            # Mid-forward: z's write the upstream holds (below the route's
            # upstream timeout) is in flight when the gateway stops; z's
            # next write, derived from it, waits in the stopped gateway.
            before = self.recorder_stats().get("held_total", 0)
            held, (op1, _) = z.send_abandoned_write(key, token, prev, n, UPSTREAM_TIMEOUT_MS - 500,
                                                    lambda: self.recorder_stats().get("held_total", 0) > before, 1.0)
            if held:
                prev, n = op1, n + 1
        inflight = self.recorder_stats().get("inflight")
        t_stop = mono()
        # The zombie write below must reach a gateway that is already
        # stopped: one sent while the stop had not yet taken hold is the
        # holder's legitimate write (it still holds the lock), and it
        # would overtake the held one.
        took = g.proc.pause()
        if took is None:
            raise RuntimeError(f"{g.name} did not stop within 5 s of SIGSTOP")
        zres = {}

        def zombie():
            # On a new connection: a kept-alive one may be closed as idle
            # the moment the gateway wakes, with the request unread.
            zres["st"], zres["code"] = z.write(key, token, prev, n, timeout=60, fresh=True)

        zt = threading.Thread(target=zombie, daemon=True)
        if ok:
            zt.start()
            time.sleep(0.2)
        rel = z.release(key, token, lease)  # through another gateway (z's api connection)
        wait_ms = int(1000 * (self.member_ttl_s + QUARANTINE_S)) + 6000
        ntok, nlease = nn.acquire(key, ttl=2000, wait=wait_ms)
        granted_after = round(mono() - t_stop, 3) if ntok is not None else None
        nst = None
        if ntok is not None:
            ok2, p2, n2 = nn.read(key, ntok)
            if ok2:
                nst, _ = nn.write(key, ntok, p2, n2)
            nn.release(key, ntok, nlease)
        until = t_stop + self.member_ttl_s + self.rng.uniform(0.5, 2.0)
        time.sleep(max(0.0, until - mono()))
        g.proc.signal(signal.SIGCONT)
        end = mono()
        if zt.is_alive() or zres:
            zt.join(65)
        z.close()
        nn.close()
        self.record_fault(kind=kind, start=start, end=end, target=g.name, key=key, token=token,
                          stopped_s=round(end - t_stop, 3), stop_took_ms=round(1000 * took, 2),
                          upstream_inflight_at_stop=inflight,
                          held_write_in_flight=held, release_st=rel,
                          successor_token=ntok, successor_granted_after_stop_s=granted_after,
                          successor_write_st=nst, zombie_write_st=zres.get("st"), zombie_write_code=zres.get("code"))

    def fault_gateway_partition(self):
        """Gateway 3 cut from etcd (its clients and upstream stay): a holder
        reads through it, the cut, the holder releases, a successor is
        granted through gateway 1 and writes through gateway 2, then the
        holder writes through gateway 3 with its old token: a gateway that
        self-fences refuses it (503 not_current); one that does not admits
        it on its stale fence view, and the write lands after the
        successor's grant."""
        kind = "gateway-partition"
        g, a, b = self.gws[2], self.gws[0], self.gws[1]
        z = Holder("nz", self.out, a.api, g.proxy)
        nn = Holder("nn", self.out, a.api, b.proxy)
        start = mono()
        key, token, lease = self.grant_own_key(z, kind, start)
        if token is None:
            z.close()
            nn.close()
            return
        ok, prev, n = z.read(key, token)
        t_cut = mono()
        self.net.cut()
        try:
            rel = z.release(key, token, lease)
            wait_ms = int(1000 * (self.member_ttl_s + QUARANTINE_S)) + 6000
            ntok, nlease = nn.acquire(key, ttl=2000, wait=wait_ms)
            granted_after = round(mono() - t_cut, 3) if ntok is not None else None
            nst = None
            if ntok is not None:
                ok2, p2, n2 = nn.read(key, ntok)
                if ok2:
                    nst, _ = nn.write(key, ntok, p2, n2)
                nn.release(key, ntok, nlease)
            zst = zcode = None
            if ok:
                zst, zcode = z.write(key, token, prev, n, fresh=True)
            until = t_cut + self.member_ttl_s + self.rng.uniform(1.0, 3.0)
            time.sleep(max(0.0, until - mono()))
        finally:
            self.net.heal()
        end = mono()
        z.close()
        nn.close()
        self.record_fault(kind=kind, start=start, end=end, target=g.name, method=self.net.method, key=key,
                          token=token, cut_s=round(end - t_cut, 3), release_st=rel, successor_token=ntok,
                          successor_granted_after_cut_s=granted_after, successor_write_st=nst,
                          zombie_write_st=zst, zombie_write_code=zcode)

    # -- the schedule
    def check_processes(self):
        for g in self.gws:
            if not g.proc.alive():
                self.unexpected.append({"process": g.name, "code": g.proc.p.returncode, "at": mono()})
                log(f"!! {g.name} exited unexpectedly with {g.proc.p.returncode}; restarting it")
                g.proc.start()
        for m in self.members:
            if not m.proc.alive():
                self.unexpected.append({"process": m.proc.name, "code": m.proc.p.returncode, "at": mono()})
                log(f"!! {m.proc.name} exited unexpectedly; restarting it")
                m.proc.start()
        if not self.recorder.alive():
            self.unexpected.append({"process": "recorder", "code": self.recorder.p.returncode, "at": mono()})
            self.recorder.start()
            self.wait_recorder()
        for c in self.clients:
            if c.p is not None and not c.alive() and mono() < self.stop_at - 1:
                self.unexpected.append({"process": c.name, "code": c.p.returncode, "at": mono()})
                log(f"!! client {c.name} exited early with {c.p.returncode}")
                c.p = None

    def run_nemesis(self):
        kinds = [k for k in self.args.faults.split(",") if k]
        first = [k for k in (self.args.first_faults or "").split(",") if k]
        queue = list(reversed(first))
        longest = 14.0  # gateway-stop: a grant, the member TTL, the quarantine, a successor's write
        gap_min = self.bound if self.args.quiet_gap is None else self.args.quiet_gap
        time.sleep(min(self.args.warmup, max(0.0, self.stop_at - mono())))
        while mono() + longest + gap_min < self.stop_at:
            self.check_processes()
            if not queue:
                queue = list(kinds)
                self.rng.shuffle(queue)
            kind = queue.pop()
            getattr(self, "fault_" + kind.replace("-", "_"))()
            self.check_processes()
            gap = gap_min + self.rng.uniform(0.5, 2.0)
            time.sleep(max(0.0, min(gap, self.stop_at - mono())))
        while mono() < self.stop_at:
            self.check_processes()
            time.sleep(min(1.0, max(0.0, self.stop_at - mono())))

    def finish(self):
        deadline = self.stop_at + 40
        for c in self.clients:
            if c.p is None:
                continue
            try:
                c.p.wait(timeout=max(0.1, deadline - mono()))
            except subprocess.TimeoutExpired:
                log(f"client {c.name} still running 40 s after the end; stopping it")
                c.stop(grace=5)
            if c.p.returncode not in (0, None):
                self.unexpected.append({"process": c.name, "code": c.p.returncode, "at": mono()})
        for g in self.gws:
            st, metrics = http("GET", g.api + "/metrics", timeout=3)
            if st == 200:
                with open(os.path.join(self.out, f"{g.name}-metrics-final.txt"), "w") as f:
                    f.write(metrics if isinstance(metrics, str) else json.dumps(metrics))
        for g in self.gws:
            code = g.proc.stop(grace=20)
            if code not in (0, None):
                self.unexpected.append({"process": g.name, "code": code, "at": mono(), "when": "graceful stop"})
        self.recorder.stop(grace=5)
        for m in self.members:
            m.proc.stop(grace=5)
        self.write_run()

    def cleanup(self):
        if self.cleaned:
            return
        self.cleaned = True
        for p in [c for c in self.clients if c.p is not None] + [g.proc for g in self.gws] + \
                [m.proc for m in self.members]:
            p.signal(signal.SIGCONT)
        if self.net is not None:
            try:
                self.net.heal()
            except (OSError, RuntimeError, subprocess.SubprocessError):
                pass
        for c in self.clients:
            if c.p is not None and c.alive():
                c.kill9()
        for p in [g.proc for g in self.gws] + [self.recorder] + [m.proc for m in self.members]:
            if p is not None and p.alive():
                p.stop(grace=5)
        if self.net is not None:
            self.net.teardown()
        if self.faults_file is not None:
            self.faults_file.close()


def main():
    ap = argparse.ArgumentParser(description="Cluster-mode nemesis harness for fencegate.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--duration", type=float, default=90, help="seconds of workload (default 90)")
    ap.add_argument("--clients", type=int, default=6, help="workload clients (default 6)")
    ap.add_argument("--resources", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--broken", choices=["no-self-fencing"], default=None,
                    help="self-test: inject this fault into every gateway (debug builds; src/fault.rs) and succeed "
                         "only if the checker finds safety anomalies")
    ap.add_argument("--binary", default=os.environ.get("FENCEGATE_BIN",
                                                       os.path.join(os.path.dirname(HERE), "target", "debug",
                                                                    "fencegate")))
    ap.add_argument("--out")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma list from {','.join(FAULTS)}")
    ap.add_argument("--first-faults", default="", help="faults run first, in this order")
    ap.add_argument("--partition", choices=["auto", "netns", "proxy"], default="auto",
                    help="how gateway 3 is cut from etcd: network namespaces if possible, else TCP proxies")
    ap.add_argument("--member-ttl-ms", type=int, default=5000, help="the gateways' member TTL (default 5000)")
    ap.add_argument("--ttl-min", type=int, default=300)
    ap.add_argument("--ttl-max", type=int, default=1000)
    ap.add_argument("--liveness-slack", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--quiet-gap", type=float, default=None,
                    help="seconds between faults (default: the liveness bound + 0.5-2 s)")
    ap.add_argument("--upstream-request-timeout", type=float, default=2.0)
    ap.add_argument("--gateway-log-level", default="warn")
    a = ap.parse_args()
    bad = [k for k in (a.faults + "," + a.first_faults).split(",") if k and k not in FAULTS]
    if bad:
        ap.error(f"unknown fault(s) {bad}; known: {FAULTS}")
    if a.clients < 3:
        ap.error("--clients must be at least 3")
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 1 << 31)
    if not os.access(a.binary, os.X_OK):
        print(f"no gateway binary at {a.binary}", file=sys.stderr)
        return 2
    a.out = os.path.abspath(a.out or tempfile.mkdtemp(prefix="fencegate-cluster-nemesis-"))
    os.makedirs(a.out, exist_ok=True)
    a.unfenced = False
    log(f"fencegate cluster nemesis run: out={a.out} seed={a.seed} duration={a.duration}s "
        f"mode={'BROKEN ' + a.broken if a.broken else 'fenced'}")
    h = ClusterHarness(a)
    atexit.register(h.cleanup)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGALRM, on_signal)
    signal.alarm(int(a.duration + 300))
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
    s = checker.check(a.out)
    text = checker.render(s) + "\n" + availability(a.out)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    print(f"histories and logs: {a.out}")
    if s.get("error"):
        return 2
    if a.broken:
        if s["safety_anomalies"] > 0:
            print(f"SELF-TEST PASSED: the checker caught the broken gateways ({s['safety_anomalies']} safety "
                  f"anomalies)")
            return 0
        print("SELF-TEST FAILED: the gateways were broken on purpose, yet the checker found nothing")
        return 1
    if s["anomalies"]:
        print(f"FAILED: {s['anomalies']} anomalies")
        return 1
    print("OK: no anomalies")
    return 0


def availability(out):
    """The availability figures of the faults that measured them."""
    rows = checker.read_jsonl(os.path.join(out, "nemesis.jsonl"))
    lines = ["  availability (s after the fault began; max over the run)"]
    by = {}
    for f in rows:
        for k in ("next_grant_s", "next_write_s", "dead_key_granted_s", "successor_granted_after_stop_s",
                  "successor_granted_after_cut_s"):
            v = f.get(k)
            if isinstance(v, (int, float)):
                by.setdefault((f["kind"], k), []).append(v)
    for (kind, k), vs in sorted(by.items()):
        lines.append(f"    {kind:<20} {k:<32} n={len(vs)} min {min(vs):.2f} max {max(vs):.2f}")
    zw = [(f["kind"], f.get("zombie_write_st"), f.get("zombie_write_code")) for f in rows
          if "zombie_write_st" in f]
    if zw:
        lines.append("    zombie writes through a stopped/cut gateway: "
                     + ", ".join(f"{k} {st} {code or ''}".strip() for k, st, code in zw))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
