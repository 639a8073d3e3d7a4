#!/usr/bin/env python3
"""History checker of the nemesis harness (standard library only).

Reads one run directory written by ``harness.py``:

    recorder.jsonl      every write the upstream applied, in applied order
    clients/*.jsonl     every operation of every client (client.py)
    nemesis.jsonl       every fault: kind, start, end (monotonic seconds)
    run.json            the run's settings (TTL, liveness bound, mode, ...)

and checks, reporting every violation as an *anomaly*:

safety
  non-monotonic       per resource, the tokens of applied writes never
                      decrease in applied order;
  sequence-order      per resource, among the applied writes of one token
                      that carry an X-Fencing-Sequence, the sequences
                      strictly increase in applied order: a holder's
                      write is never applied after a higher-numbered
                      write of the same grant, nor twice (a repeat or a
                      decrease is an anomaly);
  superseded-applied  no write is applied after a grant of a higher token
                      for its key had been received by a client (the
                      grant's answer is the latest instant activation
                      promises that older writes are finished);
  duplicate-grant     no token is granted twice for a key, before or after
                      any crash;
  grant-order         tokens follow real time: a grant that was answered
                      before another one was requested has a lower token;
  token-reuse         a token names one grant of one key: no token is
                      granted for two different keys;
  lost-grant          no acknowledged grant is lost: no two holders of a
                      key are entitled to it at once (a holder is, from its
                      grant's answer until the acquire's send time + its
                      TTL, moved to a successful renew's send time + TTL,
                      cut at its release; an answer that comes after that
                      end entitles to nothing);
  lost-ack            every write the gateway acknowledged (2xx) is in the
                      upstream's log;
  lost-update         each applied write was derived from the value applied
                      just before it on its resource (read-modify-write
                      chain unbroken: no zombie write slipped in between);
  ungranted-token     every applied write carries a token some client was
                      granted for that key;
  phantom-read        every value a read returned had been applied before
                      the read was answered;
process
  process-crash       the gateway or the recorder exited without being
                      killed by the nemesis, or a client crashed;
liveness
  liveness            after each fault ends, some client acquires a lock
                      and gets a write acknowledged with that grant within
                      ``bound`` seconds (run.json: TTL max + slack).

Prints a summary and exits 1 on any anomaly (0 otherwise, 2 if the run
directory is unusable). With ``--expect-anomalies`` (the self-test against
an unfenced gateway) it exits 0 only if safety anomalies WERE found.
"""
import argparse
import bisect
import glob
import json
import os
import sys
from collections import Counter, defaultdict

SAFETY = ["non-monotonic", "sequence-order", "superseded-applied", "duplicate-grant", "grant-order", "lost-ack",
          "lost-update", "ungranted-token", "phantom-read", "token-reuse", "lost-grant"]
LIVENESS = ["liveness"]
OTHER = ["process-crash"]


def read_jsonl(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a torn last line
    return out


def parse_value(v):
    try:
        d = json.loads(v)
        return d if isinstance(d, dict) else {}
    except (ValueError, TypeError):
        return {}


def lost_grant_holds(ops, grants):
    """Per key, (answered, entitled until, token, client) of every grant
    that carries its TTL.
    A holder is entitled from its grant's answer until the acquire's send
    time + the TTL it asked for (the authority counts the TTL from a later
    instant and may grant a longer one), moved to a successful renew's send
    time + that TTL (a renew succeeds only while the lease still lives),
    and cut at the send time of its first release. Times are true
    monotonic readings, not the client's (possibly stepped) lease clock."""
    ends = {}
    for g in grants:
        ttl = g.get("ttl")
        if isinstance(ttl, (int, float)):
            ends[(g["key"], g["token"], g["c"])] = [g["t1"], g["t0"] + ttl / 1000, None, ttl]
    for o in ops:
        k = (o.get("key"), o.get("token"), o.get("c"))
        h = ends.get(k)
        if h is None:
            continue
        if o.get("ev") == "renew" and o.get("st") == 200:
            h[1] = max(h[1], o["t0"] + h[3] / 1000)
        elif o.get("ev") == "release":
            h[2] = o["t0"] if h[2] is None else min(h[2], o["t0"])
    out = defaultdict(list)
    for (key, token, c), (t1, end, released, _) in ends.items():
        if released is not None:
            end = min(end, released)
        # An answer already past its span (the grant waited longer than its
        # TTL, e.g. in a quarantine) entitles its holder to nothing: a client
        # renews before using it, and the renewal fails.
        if end > t1:
            out[key].append((t1, end, token, c))
    return out


class Report:
    def __init__(self):
        self.anomalies = defaultdict(list)

    def add(self, kind, **detail):
        self.anomalies[kind].append(detail)

    def count(self, kinds=None):
        return sum(len(v) for k, v in self.anomalies.items() if kinds is None or k in kinds)


def check(run_dir):
    run = {}
    if os.path.exists(os.path.join(run_dir, "run.json")):
        with open(os.path.join(run_dir, "run.json")) as f:
            run = json.load(f)
    log = read_jsonl(os.path.join(run_dir, "recorder.jsonl"))
    log.sort(key=lambda r: r["seq"])
    ops = []
    for p in sorted(glob.glob(os.path.join(run_dir, "clients", "*.jsonl"))):
        ops.extend(read_jsonl(p))
    faults = read_jsonl(os.path.join(run_dir, "nemesis.jsonl"))
    rep = Report()
    stats = {}

    acquires = [o for o in ops if o.get("ev") == "acquire"]
    grants = [o for o in acquires if o.get("st") == 200]
    writes = [o for o in ops if o.get("ev") == "write"]
    reads = [o for o in ops if o.get("ev") == "read"]

    # grants per key
    by_key = defaultdict(list)
    for g in grants:
        by_key[g["key"]].append(g)

    # duplicate-grant
    for key, gs in by_key.items():
        seen = {}
        for g in gs:
            if g["token"] in seen:
                a = seen[g["token"]]
                rep.add("duplicate-grant", key=key, token=g["token"], first=a["c"], second=g["c"],
                        first_t1=a["t1"], second_t1=g["t1"])
            else:
                seen[g["token"]] = g

    # grant-order: if A was answered before B was sent, token(A) < token(B)
    for key, gs in by_key.items():
        by_t1 = sorted(gs, key=lambda g: g["t1"])
        t1s = [g["t1"] for g in by_t1]
        prefix_max = []
        best = None
        for g in by_t1:
            if best is None or g["token"] > best["token"]:
                best = g
            prefix_max.append(best)
        for b in gs:
            i = bisect.bisect_left(t1s, b["t0"])  # grants answered strictly before b was sent
            if i and prefix_max[i - 1]["token"] >= b["token"]:
                a = prefix_max[i - 1]
                rep.add("grant-order", key=key, earlier_token=a["token"], earlier_client=a["c"],
                        earlier_answered=a["t1"], later_token=b["token"], later_client=b["c"], later_sent=b["t0"])

    # token-reuse: one token, two keys
    key_of_token = {}
    for g in grants:
        other = key_of_token.setdefault(g["token"], g)
        if other["key"] != g["key"]:
            rep.add("token-reuse", token=g["token"], first_key=other["key"], first=other["c"], second_key=g["key"],
                    second=g["c"], first_t1=other["t1"], second_t1=g["t1"])

    # lost-grant: while a holder is entitled to its grant (answered, its TTL
    # counted from the acquire's or the last successful renew's send time,
    # not yet released), no other grant of the key is answered.
    holds = lost_grant_holds(ops, grants)
    for key, hs in holds.items():
        hs.sort(key=lambda h: h[0])
        prev = None  # the hold with the latest end among those answered earlier
        for h in hs:
            if prev is not None and h[0] < prev[1] and h[2] != prev[2]:
                rep.add("lost-grant", key=key, holder_token=prev[2], holder=prev[3], holder_until=prev[1],
                        other_token=h[2], other=h[3], other_answered=h[0], overlap_s=round(prev[1] - h[0], 4))
            if prev is None or h[1] > prev[1]:
                prev = h

    # superseded_at(key, token): earliest answer of a grant with a higher token
    superseded = {}
    for key, gs in by_key.items():
        srt = sorted(gs, key=lambda g: g["token"])
        toks = [g["token"] for g in srt]
        suffix = [None] * len(srt)
        best = None
        for i in range(len(srt) - 1, -1, -1):
            if best is None or srt[i]["t1"] < best["t1"]:
                best = srt[i]
            suffix[i] = best
        superseded[key] = (toks, suffix)

    def superseded_at(key, token):
        """(time, grant) of the first answered grant with a token > token."""
        if key not in superseded or not isinstance(token, int):
            return None, None
        toks, suffix = superseded[key]
        i = bisect.bisect_right(toks, token)
        if i >= len(toks):
            return None, None
        return suffix[i]["t1"], suffix[i]

    granted = {(g["key"], g["token"]) for g in grants}

    # per-resource checks over the applied log
    last = {}
    applied_by_op = {}
    top_sequence = {}  # (resource, token) -> the applied record with the highest sequence so far
    for r in log:
        res, tok = r["resource"], r["token"]
        v = parse_value(r["value"])
        # the first application of an op (a retried request may be applied again)
        applied_by_op.setdefault((res, v.get("op")), r)
        sq = r.get("sequence")
        if isinstance(sq, int) and not isinstance(sq, bool):
            top = top_sequence.get((res, tok))
            if top is not None and sq <= top["sequence"]:
                rep.add("sequence-order", resource=res, seq=r["seq"], token=tok, sequence=sq, op=v.get("op"),
                        after_seq=top["seq"], after_sequence=top["sequence"],
                        after_op=parse_value(top["value"]).get("op"),
                        shape="repeat" if sq == top["sequence"] else "decrease")
            else:
                top_sequence[(res, tok)] = r
        if (res, tok) not in granted:
            rep.add("ungranted-token", resource=res, seq=r["seq"], token=tok)
        t_sup, g_sup = superseded_at(res, tok)
        if t_sup is not None and r["applied"] > t_sup:
            rep.add("superseded-applied", resource=res, seq=r["seq"], token=tok, op=v.get("op"),
                    applied=r["applied"], superseded_by=g_sup["token"], superseded_answered=t_sup,
                    late_by_s=round(r["applied"] - t_sup, 4))
        prev = last.get(res)
        if prev is not None:
            ptok = prev["token"]
            if isinstance(tok, int) and isinstance(ptok, int) and tok < ptok:
                rep.add("non-monotonic", resource=res, seq=r["seq"], token=tok, after_seq=prev["seq"],
                        after_token=ptok)
            pv = parse_value(prev["value"])
            if v.get("prev") != pv.get("op"):
                rep.add("lost-update", resource=res, seq=r["seq"], op=v.get("op"), token=tok,
                        derived_from=v.get("prev"), but_latest_was=pv.get("op"), latest_token=ptok)
        elif v.get("prev") is not None:
            rep.add("lost-update", resource=res, seq=r["seq"], op=v.get("op"), token=tok,
                    derived_from=v.get("prev"), but_latest_was=None, latest_token=None)
        last[res] = r

    # a process of the run died on its own (or a client crashed)
    for e in run.get("unexpected_exits", []):
        rep.add("process-crash", **e)

    # lost-ack
    acked = [w for w in writes if w.get("st") is not None and 200 <= w["st"] < 300]
    for w in acked:
        r = applied_by_op.get((w["key"], w["op"]))
        if r is None or r["token"] != w["token"]:
            rep.add("lost-ack", key=w["key"], op=w["op"], token=w["token"], client=w["c"], acked_at=w["t1"])

    # phantom-read
    for rd in reads:
        if rd.get("st") == 200 and rd.get("op") is not None:
            r = applied_by_op.get((rd["key"], rd["op"]))
            if r is None or r["applied"] > rd["t1"]:
                rep.add("phantom-read", key=rd["key"], op=rd["op"], client=rd["c"], answered=rd["t1"])

    # stale writes attempted (token already superseded when the write was sent)
    stale_attempts = 0
    stale_attempts_refused = 0
    for w in writes:
        t_sup, _ = superseded_at(w["key"], w["token"])
        if t_sup is not None and w["t0"] > t_sup:
            stale_attempts += 1
            if w.get("st") == 409:
                stale_attempts_refused += 1

    # liveness
    bound = run.get("liveness_bound_s")
    run_end = run.get("stop_at")
    acked_by_grant = defaultdict(list)
    for w in acked:
        acked_by_grant[(w["key"], w["token"])].append(w["t1"])
    grants_by_t1 = sorted(grants, key=lambda g: g["t1"])
    g_t1s = [g["t1"] for g in grants_by_t1]
    recoveries = []
    unjudged = 0
    starts = sorted(f["start"] for f in faults)
    for f in faults:
        end = f.get("end")
        if end is None or bound is None:
            continue
        nxt = starts[bisect.bisect_right(starts, end):]
        if (run_end is not None and end + bound > run_end) or (nxt and nxt[0] < end + bound):
            # the run ended, or the next fault began, before the bound passed
            f["recovery_s"] = None
            unjudged += 1
            continue
        best = None
        for g in grants_by_t1[bisect.bisect_left(g_t1s, end):]:
            if g["t1"] - end > bound:
                break
            ws = [t for t in acked_by_grant.get((g["key"], g["token"]), []) if t >= end]
            if ws:
                cand = min(ws) - end
                best = cand if best is None else min(best, cand)
        f["recovery_s"] = best
        recoveries.append((f["kind"], best))
        if best is None or best > bound:
            rep.add("liveness", fault=f["kind"], fault_end=end, bound_s=bound,
                    recovery_s=None if best is None else round(best, 3))

    # partition effectiveness: ops of the cut client that completed within a cut
    cut_ok = 0
    ops_by_client = defaultdict(list)
    for o in ops:
        if o.get("ev") in ("acquire", "read", "write", "renew", "release") and o.get("st") is not None:
            ops_by_client[o.get("c")].append(o)
    for f in faults:
        if f["kind"] != "partition" or f.get("end") is None:
            continue
        for o in ops_by_client.get(f.get("target"), []):
            if o["t0"] > f["start"] + 0.05 and o["t1"] < f["end"]:
                cut_ok += 1

    def code_count(rows, code):
        return sum(1 for w in rows if w.get("st") == 409 and w.get("code") == code)

    ev = Counter(o.get("ev") for o in ops if o.get("ev") in ("acquire", "read", "write", "renew", "release"))
    fk = Counter(f["kind"] for f in faults)
    stats = {
        "mode": run.get("mode"),
        "partition_method": run.get("partition_method"),
        "duration_s": run.get("duration_s"),
        "clients": run.get("clients"),
        "seed": run.get("seed"),
        "ops": sum(ev.values()),
        "ops_by_kind": dict(ev),
        "grants": len(grants),
        "acquire_locked": sum(1 for a in acquires if a.get("st") == 409),
        "acquire_failed": sum(1 for a in acquires if a.get("st") not in (200, 409)),
        "writes_sent": len(writes),
        "writes_acked": len(acked),
        "writes_applied": len(log),
        "stale_writes_refused": code_count(writes, "stale_fencing_token"),
        "lease_expired_writes_refused": code_count(writes, "lease_expired"),
        "stale_reads_refused": code_count(reads, "stale_fencing_token"),
        "stale_sequence_writes_refused": code_count(writes, "stale_sequence"),
        "sequenced_writes_applied": sum(1 for r in log if r.get("sequence") is not None),
        "writes_failed_upstream_or_network": sum(1 for w in writes if w.get("st") is None or w["st"] >= 500),
        "stale_writes_attempted": stale_attempts,
        "stale_writes_attempted_refused": stale_attempts_refused,
        "faults": dict(fk),
        "pauses": fk.get("pause", 0),
        "kills": fk.get("gateway-kill", 0) + fk.get("upstream-kill", 0)
        + 2 * fk.get("gateway-kill-during-stall", 0),
        "gateway_kills": fk.get("gateway-kill", 0) + fk.get("gateway-kill-during-stall", 0),
        "upstream_kills": fk.get("upstream-kill", 0),
        "gateway_stops": fk.get("gateway-stop-during-stall", 0),
        "upstream_inflight_at_kill": sum(f.get("inflight_at_kill", 0) or 0 for f in faults),
        "partition_ops_completed_while_cut": cut_ok,
        "liveness_bound_s": bound,
        "liveness_unjudged_faults": unjudged,
        "liveness_max_recovery_s": max((r for _, r in recoveries if r is not None), default=None),
        "liveness_by_kind_max_s": {k: max((r for kk, r in recoveries if kk == k and r is not None), default=None)
                                   for k in sorted({k for k, _ in recoveries})},
        "anomalies": rep.count(),
        "safety_anomalies": rep.count(SAFETY),
        "liveness_anomalies": rep.count(LIVENESS),
        "anomalies_by_kind": {k: len(v) for k, v in sorted(rep.anomalies.items())},
        "anomaly_examples": {k: v[:5] for k, v in sorted(rep.anomalies.items())},
    }
    if not log and not ops:
        stats["error"] = "no history: neither the upstream log nor any client record"
    return stats


def render(s):
    r = lambda x: "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))  # noqa: E731
    lines = [
        f"fencegate nemesis summary  mode={s['mode']}  partition={s['partition_method']}  "
        f"duration={r(s['duration_s'])}s  clients={s['clients']}  seed={s['seed']}",
        f"  ops                 {s['ops']}  ({', '.join(f'{k} {v}' for k, v in sorted(s['ops_by_kind'].items()))})",
        f"  grants              {s['grants']}  (acquire 409 locked {s['acquire_locked']}, "
        f"failed {s['acquire_failed']})",
        f"  writes              sent {s['writes_sent']}, acked {s['writes_acked']}, "
        f"applied by upstream {s['writes_applied']} ({s.get('sequenced_writes_applied', 0)} sequenced), failed (5xx/network) {s['writes_failed_upstream_or_network']}",
        f"  stale writes refused {s['stale_writes_refused']} stale_fencing_token + "
        f"{s['lease_expired_writes_refused']} lease_expired + {s.get('stale_sequence_writes_refused', 0)} "
        f"stale_sequence (stale reads refused {s['stale_reads_refused']})",
        f"  zombie writes       {s['stale_writes_attempted']} sent with an already-superseded token, "
        f"{s['stale_writes_attempted_refused']} of them refused",
        f"  faults              {', '.join(f'{k} {v}' for k, v in sorted(s['faults'].items())) or 'none'}",
        f"  pauses {s['pauses']}, kills {s['kills']} (gateway {s['gateway_kills']}, upstream "
        f"{s['upstream_kills']} with {s['upstream_inflight_at_kill']} requests in flight), "
        f"gateway SIGTERM stops {s.get('gateway_stops', 0)}, "
        f"ops completed by the cut client while cut {s['partition_ops_completed_while_cut']}",
        f"  liveness            bound {r(s['liveness_bound_s'])}s, max recovery {r(s['liveness_max_recovery_s'])}s "
        f"({', '.join(f'{k} {r(v)}' for k, v in s['liveness_by_kind_max_s'].items())})"
        + (f", {s['liveness_unjudged_faults']} fault(s) not judged (too close to the end or to the next fault)"
           if s['liveness_unjudged_faults'] else ""),
        f"  anomalies           {s['anomalies']}  (safety {s['safety_anomalies']}, liveness "
        f"{s['liveness_anomalies']})" + (f": {s['anomalies_by_kind']}" if s['anomalies'] else ""),
    ]
    for k, ex in s["anomaly_examples"].items():
        for e in ex[:3]:
            lines.append(f"    {k}: {json.dumps(e, sort_keys=True)}")
    if s.get("error"):
        lines.append(f"  ERROR: {s['error']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="Check one nemesis run directory.")
    ap.add_argument("run_dir")
    ap.add_argument("--expect-anomalies", action="store_true",
                    help="self-test: exit 0 only if safety anomalies were found")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = ap.parse_args()
    s = check(args.run_dir)
    print(render(s))
    if args.json:
        print(json.dumps(s, indent=2))
    if s.get("error"):
        return 2
    if args.expect_anomalies:
        return 0 if s["safety_anomalies"] > 0 else 1
    return 1 if s["anomalies"] else 0


if __name__ == "__main__":
    sys.exit(main())
