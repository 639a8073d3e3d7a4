"""The nemesis harness's S3 mode (``harness.py --s3``; issue 16).

The same run as the HTTP mode, with a real S3 server behind an S3 route:

* s3s-fs 0.14.1 (it verifies SigV4 signatures) on loopback, its data in
  ``s3-data/`` of the run directory, the bucket ``nem`` made beforehand;
* the gateway with one route of ``kind = "s3"`` to it (``enforce = false``
  with ``--unfenced``: shadow mode, the self-test);
* N workload clients (``s3client.py``, boto3 with ``fencegate.boto3_hook``
  from ``clients/python``) doing fenced PutObject, multipart uploads
  (CreateMultipartUpload, UploadPart ×2, CompleteMultipartUpload),
  DeleteObject and DeleteObjects on a few objects, each under the lock of
  its resource ``nem/objK``;

and the faults that apply to it:

  pause            SIGSTOP a lease holder, preferably between its read and
                   its write or between the two parts of an upload, for
                   longer than any TTL, then SIGCONT (the GC pause)
  gateway-kill     kill -9 the gateway, restart it on the same data dir
  gateway-pause    SIGSTOP the gateway for longer than any TTL, SIGCONT
  gateway-restart  a clean stop (SIGTERM) and a restart at once
  upstream-kill    kill -9 s3s-fs, restart it on the same directory
  partition        client c0 cut off from the gateway (as in the HTTP mode)

then ``s3checker.py`` reads the clients' records and the objects s3s-fs
wrote (its files), and says whether fencing held.
"""
import os
import shutil
import signal
import socket
import sys
import time

import harness as h
from harness import Proc, free_port, http, log, mono

S3_FAULTS = ["pause", "gateway-kill", "gateway-pause", "gateway-restart", "upstream-kill", "partition"]
AK, SK = "fencegate-nemesis-ak", "fencegate-nemesis-secret-key"
BUCKET = "nem"


def s3s_fs_binary():
    if os.environ.get("S3S_FS"):
        return os.environ["S3S_FS"]
    home = os.environ.get("CARGO_HOME") or os.path.join(os.path.expanduser("~"), ".cargo")
    installed = os.path.join(home, "bin", "s3s-fs")
    return installed if os.access(installed, os.X_OK) else (shutil.which("s3s-fs") or installed)


class S3Harness(h.Harness):
    """The HTTP mode's harness with s3s-fs in the recorder's place (the
    base class's `recorder` is the s3s-fs process: crash checks, stops and
    clean-up treat it the same way)."""

    # The longest S3 fault: a pause of TTL max + 2.5 s after up to 1.5 s of
    # waiting for the holder to be mid-operation (the HTTP mode's staged
    # faults take up to 8 s).
    longest_fault_s = 5.0

    def start(self):
        a = self.args
        os.makedirs(os.path.join(self.out, "clients"), exist_ok=True)
        if os.path.exists(os.path.join(self.out, "nemesis.jsonl")):
            raise RuntimeError(f"{self.out} already holds a run; use a fresh --out")
        for tool, path in (("s3s-fs", a.s3s_fs), ("the venv's python (scripts/setup-s3.sh)", a.python)):
            if not os.access(path, os.X_OK):
                raise RuntimeError(f"{tool} not found at {path}: run `bash scripts/setup-s3.sh`")
        self.net = self.choose_net()
        log(f"partition method: {self.net.method}")
        gw = self.net.gw_host
        sport = free_port("127.0.0.1")
        self.s3_port = sport
        self.s3_dir = os.path.join(self.out, "s3-data")
        os.makedirs(os.path.join(self.s3_dir, BUCKET), exist_ok=True)  # the bucket: a directory to s3s-fs
        self.recorder = Proc("s3s-fs", [a.s3s_fs, "--host", "127.0.0.1", "--port", str(sport), "--access-key", AK,
                                        "--secret-key", SK, self.s3_dir], os.path.join(self.out, "s3s-fs.log"))
        self.recorder.start()
        self.wait_recorder()
        pport, aport = free_port(gw), free_port(gw)
        self.api, self.proxy = f"http://{gw}:{aport}", f"http://{gw}:{pport}"
        conf = os.path.join(self.out, "gateway.toml")
        with open(conf, "w") as f:
            f.write(f"""# written by nemesis/harness.py --s3 ({'UNFENCED self-test: shadow mode' if a.unfenced else 'fenced'})
data_dir = "{os.path.join(self.out, 'gw-data')}"
listen = "{gw}:{pport}"
api_listen = "{gw}:{aport}"
log_level = "{a.gateway_log_level}"

[locks]
activation_timeout_ms = {2 * h.UPSTREAM_TIMEOUT_MS}

[[routes]]
name = "nemesis-s3"
kind = "s3"
upstream = "http://127.0.0.1:{sport}"
enforce = {'false' if a.unfenced else 'true'}
upstream_timeout_ms = {h.UPSTREAM_TIMEOUT_MS}
connect_timeout_ms = 1000
""")
        r = h.subprocess.run([a.binary, "check-config", conf], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"gateway config refused: {r.stdout}{r.stderr}")
        self.gateway = Proc("gateway", [a.binary, "serve", "--config", conf], os.path.join(self.out, "gateway.log"))
        self.gateway.start()
        self.wait_gateway()
        self.t0 = mono()
        self.stop_at = self.t0 + a.duration
        self.faults_file = open(os.path.join(self.out, "nemesis.jsonl"), "a", buffering=1)
        for i in range(a.clients):
            name = f"c{i}"
            partitioned = i == 0
            api, proxy = self.net.client_endpoints(self.api, self.proxy) if partitioned else (self.api, self.proxy)
            argv = [a.python, os.path.join(h.HERE, "s3client.py"), "--id", name, "--api", api, "--proxy", proxy,
                    "--resources", str(a.resources), "--ttl-min", str(self.ttl_min), "--ttl-max", str(self.ttl_max),
                    "--record", os.path.join(self.out, "clients", f"{name}.jsonl"),
                    "--stop-at", f"{self.stop_at:.3f}", "--seed", str(a.seed * 1000 + i),
                    "--access-key", AK, "--secret-key", SK]
            p = Proc(name, self.net.wrap(argv, partitioned), os.path.join(self.out, "clients", f"{name}.log"))
            p.start()
            self.clients.append(p)
        self.run_info = {
            "mode": "unfenced" if a.unfenced else "fenced", "s3": True, "partition_method": self.net.method,
            "partitioned_client": "c0", "clients": a.clients, "resources": a.resources, "seed": a.seed,
            "duration_s": a.duration, "ttl_min_ms": self.ttl_min, "ttl_max_ms": self.ttl_max,
            "liveness_bound_s": self.bound, "start": self.t0, "stop_at": self.stop_at,
            "faults_enabled": a.faults, "first_faults": a.first_faults, "binary": a.binary,
            "gateway_api": self.api, "gateway_proxy": self.proxy, "s3_data_dir": self.s3_dir, "s3_bucket": BUCKET,
            "s3_objects": [f"{BUCKET}/obj{k}" for k in range(a.resources)], "argv": sys.argv,
        }
        self.write_run()
        log(f"{a.clients} S3 clients on {a.resources} objects, TTL {self.ttl_min}-{self.ttl_max} ms, "
            f"gateway api {self.api} proxy {self.proxy} -> s3s-fs 127.0.0.1:{sport} "
            f"({'UNFENCED shadow mode' if a.unfenced else 'fenced'})")

    def wait_recorder(self, timeout=15):
        """Waits until s3s-fs accepts connections."""
        deadline = mono() + timeout
        while mono() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.s3_port), timeout=0.5):
                    return mono()
            except OSError:
                pass
            if not self.recorder.alive():
                break
            time.sleep(0.05)
        raise RuntimeError("s3s-fs did not come up (see s3s-fs.log)")

    def pick_holder(self):
        holders = []
        for k in range(self.args.resources):
            st, body = http("GET", f"{self.api}/v1/locks/status?key={BUCKET}/obj{k}", timeout=1)
            if st == 200 and isinstance(body, dict) and body.get("held"):
                holders.append(body.get("holder"))
        byname = {c.name: c for c in self.clients if c.alive()}
        cands = [byname[hh] for hh in holders if hh in byname]
        return self.rng.choice(cands or list(byname.values())), bool(cands)

    def wait_in_think(self, c, up_to):
        """Waits (at most `up_to` s) until client `c` is between a read and
        its write, or between the two parts of an upload."""
        look_until = mono() + up_to
        while mono() < look_until:
            ev = self.last_event(c)
            if ev.get("ev") == "read" and ev.get("st") in (200, 404):
                return "read"
            if ev.get("ev") == "mpu-part" and ev.get("part") == 1 and ev.get("st") == 200:
                return "mid-upload"
            time.sleep(0.005)
        return None

    def fault_pause(self):
        c, held = self.pick_holder()
        d = self.rng.uniform(self.ttl_max / 1000 + 0.5, self.ttl_max / 1000 + 2.5)
        where = self.wait_in_think(c, 1.5) if held else None
        start = mono()
        c.signal(signal.SIGSTOP)
        time.sleep(d)
        c.signal(signal.SIGCONT)
        self.record_fault(kind="pause", start=start, end=mono(), target=c.name, pid=c.pid, was_holder=held,
                          where=where)

    def fault_gateway_pause(self):
        d = self.rng.uniform(self.ttl_max / 1000 + 0.5, self.ttl_max / 1000 + 2.0)
        start = mono()
        if self.gateway.pause() is None:
            raise RuntimeError("the gateway did not stop within 5 s of SIGSTOP")
        time.sleep(d)
        self.gateway.signal(signal.SIGCONT)
        self.record_fault(kind="gateway-pause", start=start, end=mono(), seconds=round(d, 3))

    def fault_gateway_restart(self):
        start = mono()
        code = self.gateway.stop(grace=15)
        stopped = mono()
        self.gateway.start()
        end = mono()
        ready = self.wait_gateway()
        self.record_fault(kind="gateway-restart", start=start, end=end, stop_s=round(stopped - start, 3),
                          exit_code=code, ready_after_s=round(ready - end, 3), pid=self.gateway.pid)

    def fault_upstream_kill(self):
        start = mono()
        self.recorder.kill9()
        time.sleep(self.rng.uniform(0.2, 1.0))
        self.recorder.start()
        end = mono()
        self.wait_recorder()
        self.record_fault(kind="upstream-kill", start=start, end=end, pid=self.recorder.pid)
