"""A small client of fencegate's lease API, standard library only.

    lease = fencegate.Lease.acquire("http://127.0.0.1:7070", "bkt/report.csv", ttl_ms=10_000)
    fencegate.boto3_hook(s3_client, lease)          # every S3 call carries the token (signed)
    ...
    if lease.lost: stop writing
    lease.release()

A lease renews itself in a background thread at a third of its TTL. Once a
renewal is refused (410 lease_lost) or the lease's time has run out by the
client's own monotonic clock (started before acquire was sent), `lost` is
True and stays True: the holder must stop. The fence at the gateway refuses
its writes in any case; `lost` only lets it learn early.
"""

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["Lease", "LeaseError", "boto3_hook", "requests_hook", "httpx_hook", "tokens_header"]

TOKEN_HEADER = "X-Fencing-Token"
TOKENS_HEADER = "X-Fencing-Tokens"


class LeaseError(Exception):
    """The API refused a call; `code` is its JSON `error` code."""

    def __init__(self, status, code, message, body=None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.body = status, code, body or {}


def _call(api, path, body, timeout):
    req = urllib.request.Request(
        api.rstrip("/") + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            j = json.loads(e.read())
        except ValueError:
            j = {}
        raise LeaseError(e.code, j.get("error", ""), j.get("message", ""), j) from None


class Lease:
    """One grant: `key`, `token` (the fencing token), renewed in the background."""

    def __init__(self, api, key, token, lease_id, ttl_ms, started):
        self.api, self.key, self.token, self.lease_id, self.ttl_ms = api, key, token, lease_id, ttl_ms
        self._deadline = started + ttl_ms / 1000.0
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, api, key, ttl_ms=10_000, wait_ms=0, holder=None):
        started = time.monotonic()  # before the request: never overestimates
        body = {"key": key, "ttl_ms": ttl_ms, "wait_ms": wait_ms}
        if holder:
            body["holder"] = holder
        g = _call(api, "/v1/locks/acquire", body, timeout=wait_ms / 1000.0 + 10)
        return cls(api, key, g["fencing_token"], g["lease_id"], g["ttl_ms"], started)

    @property
    def lost(self):
        return self._lost or time.monotonic() >= self._deadline

    def _renew_loop(self):
        while not self._stop.wait(self.ttl_ms / 3000.0):
            started = time.monotonic()
            try:
                g = _call(self.api, "/v1/locks/renew", {"key": self.key, "lease_id": self.lease_id}, timeout=5)
                self._deadline = started + g["ttl_ms"] / 1000.0
            except LeaseError as e:
                if e.code == "lease_lost":
                    self._lost = True
                    return
            except OSError:
                pass  # the deadline decides
            if self.lost:
                return

    def stop_renewing(self):
        """Stops the background renewals, keeping the lease until it runs
        out (what a paused process looks like to the gateway; for tests
        and demonstrations)."""
        self._stop.set()

    def release(self):
        self._stop.set()
        self._lost = True
        try:
            _call(self.api, "/v1/locks/release", {"key": self.key, "lease_id": self.lease_id}, timeout=5)
        except (LeaseError, OSError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def tokens_header(tokens):
    """`X-Fencing-Tokens` for {resource: token} (resources percent-encoded)."""
    return ", ".join(f"{urllib.parse.quote(r, safe='/')}={t}" for r, t in tokens.items())


def _token_of(source):
    return source() if callable(source) else getattr(source, "token", source)


def boto3_hook(client, source, signed=True, tokens=None):
    """Adds `X-Fencing-Token` (from a Lease, a number, or a callable) to every
    S3 request of a boto3 client. signed=True adds it in `before-sign` (it is
    signed into SigV4 and presigned URLs); False in `before-send` (unsigned).
    `tokens`: a callable returning {resource: token} for `X-Fencing-Tokens`
    (DeleteObjects, RenameObject). Returns the handler (to unregister)."""

    def add(request, **_):
        t = _token_of(source) if source is not None else None
        if t is not None:
            request.headers[TOKEN_HEADER] = str(t)
        m = tokens() if tokens else None
        if m:
            request.headers[TOKENS_HEADER] = tokens_header(m)

    event = "before-sign.s3.*" if signed else "before-send.s3.*"
    client.meta.events.register(event, add)
    return add


def requests_hook(session, source):
    """Adds the token to every request of a `requests.Session`."""

    class _Auth:
        def __call__(self, r):
            r.headers[TOKEN_HEADER] = str(_token_of(source))
            return r

    session.auth = _Auth()
    return session


def httpx_hook(source):
    """An `event_hooks` entry for httpx: `httpx.Client(event_hooks={"request": [httpx_hook(lease)]})`."""

    def hook(request):
        request.headers[TOKEN_HEADER] = str(_token_of(source))

    return hook
