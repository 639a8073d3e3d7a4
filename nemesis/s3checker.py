#!/usr/bin/env python3
"""Checker of the nemesis harness's S3 mode (standard library only).

Reads a run directory: the clients' records (``clients/*.jsonl``, written
by ``s3client.py``), the faults (``nemesis.jsonl``), ``run.json``, and what
s3s-fs actually wrote: each object's file under its data directory
(``s3-data/nem/objK``). An object's body is a chain of JSON lines, one per
write that built it since the last delete (see ``s3client.py``), so the
final file lists, in order, the writes the store applied; and every read
recorded the chain s3s-fs served then, so the states between deletes are
known too.

A mutation is *acknowledged* when the gateway answered 2xx; *refused* when
it answered 4xx; its outcome is *unknown* otherwise (5xx, no answer).
A grant *supersedes* a token t of its key once a grant of a higher token
for that key has been answered to some client.

| anomaly | property |
|---|---|
| duplicate-grant | no token is granted twice (tokens are unique across keys) |
| superseded-acked | no mutation (PutObject, CreateMultipartUpload, UploadPart, CompleteMultipartUpload, DeleteObject, DeleteObjects) sent with an already-superseded token is acknowledged |
| superseded-applied | no write sent with an already-superseded token is in any state of the object s3s-fs held (a chain one of its reads served, or its final file), whatever the write's answer |
| non-monotonic | along every such chain the tokens never decrease |
| ungranted-token | every line of such a chain carries a token granted for that object |
| lost-ack | every acknowledged write is in its object's final chain, unless a delete (not refused) removed it: its deleter's read just before the delete saw the write |
| final-not-latest | the final state is at or after the latest acknowledged mutation of the highest token: that write is in the chain or something of a higher token replaced it; after such a delete, the object is absent or rebuilt by writes sent after it |
| malformed-object | every object file, and every body a read was served, is a chain of lines (no torn or foreign body) |
| process-crash | the gateway or s3s-fs died on its own, or a client crashed |
| liveness | after each fault, some client is granted a lock and gets a mutation acknowledged with it within the bound |

    python3 nemesis/s3checker.py RUN_DIR     # exit 0 clean, 1 anomalies, 2 unreadable run
"""
import glob
import json
import os
import sys
from collections import Counter, defaultdict

WRITES = ("put", "mpu-complete")
DELETES = ("delete", "delete-objects")
OBJECT_KINDS = ("superseded-applied", "non-monotonic", "ungranted-token", "lost-ack", "final-not-latest",
                "malformed-object")
MUTATIONS = ("put", "mpu-create", "mpu-part", "mpu-complete", "delete", "delete-objects")


def read_jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by kill -9 of its writer
    except FileNotFoundError:
        pass
    return out


def acked(r):
    return isinstance(r.get("st"), int) and 200 <= r["st"] < 300


def refused(r):
    return isinstance(r.get("st"), int) and 400 <= r["st"] < 500


def final_objects(data_dir, bucket, keys):
    """{resource: list of lines, or None if absent, or "malformed"}."""
    out = {}
    for key in keys:
        path = os.path.join(data_dir, bucket, key.split("/", 1)[1])
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            out[key] = None
            continue
        lines = []
        for line in raw.decode("utf-8", "replace").splitlines():
            if not line.strip():
                continue  # the padding line of a two-part upload
            try:
                v = json.loads(line)
                if not isinstance(v, dict) or "id" not in v or "t" not in v:
                    raise ValueError
                lines.append(v)
            except ValueError:
                lines = "malformed"
                break
        out[key] = lines
    return out


def check(out_dir, final=None):
    """The summary dict. `final` ({resource: chain | None}) replaces the
    object files (unit tests)."""
    try:
        with open(os.path.join(out_dir, "run.json")) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        return {"error": f"run.json unreadable: {e}", "anomalies": 0, "safety_anomalies": 0}
    recs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "clients", "*.jsonl"))):
        recs += read_jsonl(path)
    faults = read_jsonl(os.path.join(out_dir, "nemesis.jsonl"))
    anomalies = []

    def anomaly(kind, **kv):
        anomalies.append({"kind": kind, **kv})

    grants = [r for r in recs if r.get("ev") == "acquire" and r.get("st") == 200 and r.get("token") is not None]
    by_token = defaultdict(list)
    for g in grants:
        by_token[g["token"]].append(g)
    for t, gs in by_token.items():
        if len(gs) > 1:
            anomaly("duplicate-grant", token=t, grants=[(g["c"], g["key"], g["t1"]) for g in gs])
    granted = defaultdict(set)
    answers = defaultdict(list)  # key -> [(answered, token)]
    for g in grants:
        granted[g["key"]].add(g["token"])
        answers[g["key"]].append((g["t1"], g["token"]))

    def superseded_at(key, token, t):
        """The first higher grant of `key` answered before `t`, or None."""
        best = None
        for answered, tok in answers[key]:
            if tok > token and answered < t and (best is None or answered < best[0]):
                best = (answered, tok)
        return best

    muts = [r for r in recs if r.get("ev") in MUTATIONS]
    zombies = zombie_refused = 0
    for m in muts:
        s = superseded_at(m["key"], m["token"], m["t0"])
        if s is None:
            continue
        zombies += 1
        if refused(m):
            zombie_refused += 1
        elif acked(m):
            anomaly("superseded-acked", client=m["c"], key=m["key"], ev=m["ev"], token=m["token"], sent=m["t0"],
                    superseded_by=s[1], superseded_at=s[0], id=m.get("id"))

    # What s3s-fs served: every chain a read returned (ids and tokens).
    reads = [r for r in recs if r.get("ev") == "read" and r.get("st") == 200 and r.get("chain")]
    last_read = {}  # (client, key, token) -> reads in time order, to find the one before a delete
    for r in sorted(reads, key=lambda r: r["t0"]):
        last_read.setdefault((r["c"], r["key"], r["token"]), []).append(r)

    def read_before(d):
        """The ids the deleter's last read before the delete saw (None: it read 404 or nothing)."""
        best = None
        for r in last_read.get((d["c"], d["key"], d["token"]), []):
            if r["t1"] <= d["t0"]:
                best = r
        return {x[0] for x in best["chain"]} if best else set()

    keys = sorted({r["key"] for r in recs if r.get("key")} | set(run.get("s3_objects", [])))
    if final is None:
        final = final_objects(run["s3_data_dir"], run.get("s3_bucket", "nem"), keys)
    writes_by_id = {m["id"]: m for m in muts if m.get("ev") in WRITES and m.get("id")}
    for key in keys:
        chain = final.get(key)
        if chain == "malformed":
            anomaly("malformed-object", key=key)
            continue
        chain = chain or []
        ids = {line["id"] for line in chain}
        # Every state of the object s3s-fs is known to have held: the
        # chains its reads served, and its final file.
        states = [[(x[0], x[1]) for x in r["chain"]] for r in reads if r["key"] == key]
        states.append([(line["id"], line["t"]) for line in chain])
        seen_bad, seen_mono = set(), set()
        for state in states:
            for i, (wid, tok) in enumerate(state):
                if tok not in granted[key] and ("ungranted", wid) not in seen_bad:
                    seen_bad.add(("ungranted", wid))
                    anomaly("ungranted-token", key=key, id=wid, token=tok)
                if i and tok < state[i - 1][1] and (wid, state[i - 1][0]) not in seen_mono:
                    seen_mono.add((wid, state[i - 1][0]))
                    anomaly("non-monotonic", key=key, id=wid, token=tok, after=state[i - 1][0],
                            after_token=state[i - 1][1])
                w = writes_by_id.get(wid)
                if w is not None and ("stale", wid) not in seen_bad:
                    s = superseded_at(key, w["token"], w["t0"])
                    if s is not None:
                        seen_bad.add(("stale", wid))
                        anomaly("superseded-applied", key=key, id=wid, token=w["token"], sent=w["t0"],
                                superseded_by=s[1], st=w.get("st"))
        mine = [m for m in muts if m["key"] == key]
        deletes = [m for m in mine if m["ev"] in DELETES and not refused(m)]
        for w in mine:
            if w["ev"] not in WRITES or not acked(w) or w["id"] in ids:
                continue
            # A delete that removed it: its deleter read the object just
            # before and saw the write there (under fencing every later
            # holder's read sees an acknowledged write until a delete).
            removed = any(w["id"] in read_before(d) for d in deletes)
            if not removed:
                anomaly("lost-ack", key=key, id=w["id"], token=w["token"], client=w["c"], answered=w["t1"])
        done = [m for m in mine if (m["ev"] in WRITES or m["ev"] in DELETES) and acked(m)]
        if done:
            latest = max(done, key=lambda m: (m["token"], m["t1"]))
            t = latest["token"]
            if latest["ev"] in WRITES:
                # Its write, or a higher token's, is what the object ends with.
                ok = (chain and (chain[-1]["t"] > t or (chain[-1]["t"] == t and latest["id"] in ids))) or (
                    not chain and any((d["token"] > t and d["t0"] > latest["t0"])
                                      or (d["token"] == t and d["t0"] >= latest["t1"]) for d in deletes))
            else:
                first = writes_by_id.get(chain[0]["id"]) if chain else None
                ok = not chain or chain[0]["t"] > t or (
                    first is not None and first["token"] == t and first["t0"] >= latest["t0"])
            if not ok:
                anomaly("final-not-latest", key=key, latest=latest["ev"], latest_id=latest.get("id"), token=t,
                        final_last=(chain[-1]["id"], chain[-1]["t"]) if chain else None)

    for r in recs:
        if r.get("ev") == "read" and r.get("st") == 200 and r.get("err") == "not a chain":
            anomaly("malformed-object", key=r["key"], served_to=r["c"], at=r["t1"])
    for u in run.get("unexpected_exits", []):
        anomaly("process-crash", **u)

    # Liveness: after each fault, a grant answered after its end and a
    # mutation acknowledged under that grant, within the bound.
    bound = run.get("liveness_bound_s", 7.0)
    stop_at = run.get("stop_at", float("inf"))
    ends = sorted(f["end"] for f in faults)
    starts = sorted(f["start"] for f in faults)
    recoveries = {}
    judged = unjudged = 0
    ok_by_grant = defaultdict(list)
    for m in muts:
        if m["ev"] in WRITES + DELETES and acked(m):
            ok_by_grant[(m["c"], m["key"], m["token"])].append(m["t1"])
    for f in faults:
        end = f["end"]
        nxt = min([s for s in starts if s > end] + [stop_at])
        if nxt < end + bound:
            unjudged += 1
            continue
        judged += 1
        best = None
        for g in grants:
            if g["t1"] < end:
                continue
            for t1 in ok_by_grant.get((g["c"], g["key"], g["token"]), []):
                if t1 >= end and (best is None or t1 < best):
                    best = t1
        rec = None if best is None else best - end
        recoveries.setdefault(f["kind"], []).append(rec)
        if rec is None or rec > bound:
            anomaly("liveness", fault=f["kind"], end=end, recovery=rec, bound=bound)
    del ends

    evs = Counter(r.get("ev") for r in recs)
    codes = Counter(m.get("code") for m in muts if refused(m))
    safety = [a for a in anomalies if a["kind"] not in ("liveness",)]
    return {
        "mode": run.get("mode"), "duration_s": run.get("duration_s"), "seed": run.get("seed"),
        "partition_method": run.get("partition_method"), "clients": run.get("clients"),
        "ops": len(recs), "ops_by_ev": dict(sorted(evs.items())),
        "grants": len(grants),
        "mutations_sent": len(muts), "mutations_acked": sum(acked(m) for m in muts),
        "mutations_refused_by_code": dict(codes),
        "mutations_unknown": sum(not acked(m) and not refused(m) for m in muts),
        "writes_acked": sum(acked(m) for m in muts if m["ev"] in WRITES),
        "zombie_mutations": zombies, "zombie_refused": zombie_refused,
        "objects": {k: (None if final.get(k) is None else
                        ("malformed" if final.get(k) == "malformed" else len(final[k]))) for k in keys},
        "faults": dict(Counter(f["kind"] for f in faults)),
        "faults_judged": judged, "faults_unjudged": unjudged, "liveness_bound_s": bound,
        "max_recovery_s": {k: max((v for v in vs if v is not None), default=None) for k, vs in recoveries.items()},
        "anomalies": len(anomalies), "safety_anomalies": len(safety),
        # Seen in what s3s-fs held (its files, the chains it served), not
        # only in the gateway's answers.
        "object_anomalies": sum(a["kind"] in OBJECT_KINDS for a in anomalies),
        "anomalies_by_kind": dict(Counter(a["kind"] for a in anomalies)),
        "anomaly_examples": anomalies[:12],
    }


def render(s):
    if s.get("error"):
        return f"fencegate nemesis (s3) summary: ERROR {s['error']}"
    rec = ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in sorted(s["max_recovery_s"].items()))
    lines = [
        f"fencegate nemesis summary  mode={s['mode']} (s3, s3s-fs)  partition={s['partition_method']}  "
        f"duration={s['duration_s']}s  clients={s['clients']}  seed={s['seed']}",
        f"  ops                 {s['ops']}  ({', '.join(f'{k} {v}' for k, v in s['ops_by_ev'].items())})",
        f"  grants              {s['grants']}",
        f"  mutations           sent {s['mutations_sent']}, acked {s['mutations_acked']} "
        f"(writes {s['writes_acked']}), refused {sum(s['mutations_refused_by_code'].values())} "
        f"{s['mutations_refused_by_code']}, unknown outcome {s['mutations_unknown']}",
        f"  zombie mutations    {s['zombie_mutations']} sent with an already-superseded token, "
        f"{s['zombie_refused']} of them refused",
        f"  objects (lines)     {s['objects']}",
        f"  faults              {', '.join(f'{k} {v}' for k, v in sorted(s['faults'].items()))}",
        f"  liveness            bound {s['liveness_bound_s']:.2f}s, judged {s['faults_judged']} "
        f"(unjudged {s['faults_unjudged']}), max recovery: {rec}",
        f"  anomalies           {s['anomalies']}  (safety {s['safety_anomalies']}, in the objects "
        f"{s['object_anomalies']}) {s['anomalies_by_kind']}",
    ]
    for a in s["anomaly_examples"]:
        lines.append(f"    {json.dumps(a)}")
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        print("usage: s3checker.py RUN_DIR", file=sys.stderr)
        return 2
    s = check(sys.argv[1])
    print(render(s))
    if s.get("error"):
        return 2
    return 1 if s["anomalies"] else 0


if __name__ == "__main__":
    sys.exit(main())
