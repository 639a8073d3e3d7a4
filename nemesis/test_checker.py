#!/usr/bin/env python3
"""Unit tests of checker.py on hand-made histories: each check fires on the
anomaly it names and stays quiet on a clean history.

    python3 -m unittest nemesis/test_checker.py
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checker  # noqa: E402


def value(op, prev, tok):
    return json.dumps({"op": op, "prev": prev, "n": 0, "by": op.split(":")[0], "tok": tok})


class History:
    """Builds a run directory: grants, writes, reads, applied log, faults."""

    def __init__(self):
        self.ops, self.log, self.faults = [], [], []
        self.run = {"liveness_bound_s": 4.0, "stop_at": 1000.0, "mode": "test"}

    def grant(self, c, key, token, t0, t1, ttl=None):
        g = {"ev": "acquire", "c": c, "key": key, "token": token, "t0": t0, "t1": t1, "st": 200}
        if ttl is not None:
            g["ttl"] = ttl
        self.ops.append(g)

    def lease_op(self, ev, c, key, token, t0, t1, st=200):
        self.ops.append({"ev": ev, "c": c, "key": key, "token": token, "t0": t0, "t1": t1, "st": st})

    def write(self, c, key, token, op, prev, t0, t1, st=200, apply_at=None, sequence=None, code=None):
        v = value(op, prev, token)
        w = {"ev": "write", "c": c, "key": key, "token": token, "op": op, "prev": prev, "t0": t0, "t1": t1,
             "st": st, "code": code, "value": v}
        if sequence is not None:
            w["sequence"] = sequence
        self.ops.append(w)
        if apply_at is not None:
            self.apply(key, token, v, apply_at, sequence)

    def apply(self, key, token, v, at, sequence=None):
        r = {"seq": len(self.log) + 1, "resource": key, "token": token, "value": v, "arrival": at, "applied": at}
        if sequence is not None:
            r["sequence"] = sequence
        self.log.append(r)

    def in_applied_order(self):
        self.log.sort(key=lambda r: r["applied"])
        for i, r in enumerate(self.log, 1):
            r["seq"] = i
        return self

    def read(self, c, key, token, op, t0, t1):
        self.ops.append({"ev": "read", "c": c, "key": key, "token": token, "op": op, "t0": t0, "t1": t1, "st": 200})

    def check(self):
        d = tempfile.mkdtemp(prefix="checker-test-")
        try:
            os.makedirs(os.path.join(d, "clients"))
            with open(os.path.join(d, "run.json"), "w") as f:
                json.dump(self.run, f)
            for name, rows in (("recorder.jsonl", self.log), ("nemesis.jsonl", self.faults),
                               ("clients/all.jsonl", self.ops)):
                with open(os.path.join(d, name), "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
            return checker.check(d)["anomalies_by_kind"]
        finally:
            shutil.rmtree(d)


def clean():
    """Two holders of k, one after the other, each reading then writing."""
    h = History()
    h.grant("a", "k", 1, 0.0, 0.1)
    h.write("a", "k", 1, "a:1", None, 0.3, 0.35, apply_at=0.32)
    h.grant("b", "k", 2, 0.5, 1.0)
    h.read("b", "k", 2, "a:1", 1.1, 1.12)
    h.write("b", "k", 2, "b:1", "a:1", 1.2, 1.25, apply_at=1.22)
    return h


class CheckerTest(unittest.TestCase):
    def test_clean_history_has_no_anomaly(self):
        self.assertEqual(clean().check(), {})

    def test_decreasing_tokens_are_non_monotonic(self):
        h = clean()
        h.write("a", "k", 1, "a:2", "b:1", 1.3, 1.4, apply_at=1.35)  # the zombie comes back
        got = h.check()
        self.assertIn("non-monotonic", got)
        self.assertIn("superseded-applied", got)

    def test_write_applied_after_newer_grant_is_superseded(self):
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1)
        h.grant("b", "k", 2, 0.5, 1.0)
        h.write("a", "k", 1, "a:1", None, 0.3, 1.2, apply_at=1.1)  # applied after b's grant was answered
        self.assertEqual(h.check(), {"superseded-applied": 1})

    def abandoned_write_across_a_stop(self, zombie_applied_at):
        """The shape of gateway-stop-during-stall: nz's write (token 2) is
        held by the upstream, nz gives up (no answer), the gateway is
        stopped and restarted, nn is granted token 3 at 1.1 and writes."""
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1)
        h.write("a", "k", 1, "a:1", None, 0.15, 0.2, apply_at=0.18)
        h.grant("nz", "k", 2, 0.3, 0.35)
        h.read("nz", "k", 2, "a:1", 0.4, 0.45)
        h.write("nz", "k", 2, "nz:1", "a:1", 0.5, 0.7, st=None, apply_at=zombie_applied_at)
        h.grant("nn", "k", 3, 1.0, 1.1)
        seen = "nz:1" if zombie_applied_at < 1.2 else "a:1"
        h.read("nn", "k", 3, seen, 1.2, 1.25)
        h.write("nn", "k", 3, "nn:1", seen, 1.3, 1.35, apply_at=1.32)
        h.log.sort(key=lambda r: r["applied"])
        for i, r in enumerate(h.log, 1):
            r["seq"] = i
        return h.check()

    def test_abandoned_write_applied_after_the_restart_grant(self):
        # No quarantine after a stop marked clean too early: the held write
        # lands after nn's grant and nn's write.
        self.assertEqual(self.abandoned_write_across_a_stop(1.9),
                         {"superseded-applied": 1, "non-monotonic": 1, "lost-update": 1})

    def test_abandoned_write_applied_during_the_stop_is_clean(self):
        # The stop waited for it: applied before the restart and nn's grant.
        self.assertEqual(self.abandoned_write_across_a_stop(0.9), {})

    def holder_retry(self, second_applied_at, retry_applied_at=None):
        """The shape of the holder-retry fault: holder a (token 1) writes
        sequence 1, then sequence 2 (a:2) which the upstream holds until
        0.9, gives up on it, sends sequence 3 (a:3, derived from a:2) on a
        new connection at 0.5, then retries sequence 2 (the same request)
        at 1.0. An enforcing gateway makes 3 wait for 2 and refuses the
        retry with 409 stale_sequence; a gateway that ignores the header
        applies the retry after 3 (shadow mode), or does not wait."""
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1)
        h.read("a", "k", 1, None, 0.12, 0.13)
        h.write("a", "k", 1, "a:1", None, 0.15, 0.2, apply_at=0.18, sequence=1)
        h.write("a", "k", 1, "a:2", "a:1", 0.3, 0.4, st=None, apply_at=0.9, sequence=2)
        h.write("a", "k", 1, "a:3", "a:2", 0.5, second_applied_at + 0.01, apply_at=second_applied_at, sequence=3)
        if retry_applied_at is None:
            h.write("a", "k", 1, "a:2", "a:1", 1.0, 1.01, st=409, code="stale_sequence", sequence=2)
        else:
            h.write("a", "k", 1, "a:2", "a:1", 1.0, retry_applied_at + 0.01, apply_at=retry_applied_at, sequence=2)
        return h.in_applied_order().check()

    def test_holder_retry_ordered_and_refused_is_clean(self):
        self.assertEqual(self.holder_retry(0.95), {})

    def test_holder_retry_applied_after_the_higher_sequence(self):
        # shadow mode: the retry of sequence 2 lands after sequence 3
        self.assertEqual(self.holder_retry(0.95, retry_applied_at=1.05), {"sequence-order": 1, "lost-update": 1})

    def test_higher_sequence_not_waiting_for_the_lower_one(self):
        # sequence 3 applied at 0.6, before the held sequence 2 (0.9)
        self.assertEqual(self.holder_retry(0.6), {"sequence-order": 1, "lost-update": 2})

    def test_sequence_order_reports_a_repeat_and_a_decrease(self):
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1)
        h.write("a", "k", 1, "a:1", None, 0.2, 0.25, apply_at=0.22, sequence=5)
        h.write("a", "k", 1, "a:2", "a:1", 0.3, 0.35, apply_at=0.32, sequence=5)
        h.write("a", "k", 1, "a:3", "a:2", 0.4, 0.45, apply_at=0.42, sequence=4)
        h.write("a", "k", 1, "a:4", "a:3", 0.5, 0.55, apply_at=0.52, sequence=6)
        d = tempfile.mkdtemp(prefix="checker-test-")
        try:
            os.makedirs(os.path.join(d, "clients"))
            for name, rows in (("recorder.jsonl", h.log), ("clients/all.jsonl", h.ops)):
                with open(os.path.join(d, name), "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
            got = checker.check(d)
        finally:
            shutil.rmtree(d)
        self.assertEqual(got["anomalies_by_kind"], {"sequence-order": 2})
        ex = got["anomaly_examples"]["sequence-order"]
        self.assertEqual([(e["sequence"], e["after_sequence"], e["shape"]) for e in ex],
                         [(5, 5, "repeat"), (4, 5, "decrease")])

    def test_a_new_token_starts_a_new_sequence(self):
        h = clean()  # a (token 1) and b (token 2), one write each
        h.log[0]["sequence"] = 7
        h.log[1]["sequence"] = 1  # lower, but under a newer token
        h.write("b", "k", 2, "b:2", "b:1", 1.3, 1.35, apply_at=1.32)  # unsequenced: not judged
        h.write("b", "k", 2, "b:3", "b:2", 1.4, 1.45, apply_at=1.42, sequence=2)
        self.assertEqual(h.check(), {})

    def test_token_granted_twice(self):
        h = clean()
        h.grant("c", "k", 2, 2.0, 2.1)
        self.assertIn("duplicate-grant", h.check())

    def test_one_token_granted_for_two_keys(self):
        h = clean()
        h.grant("c", "j", 2, 2.0, 2.1)
        self.assertEqual(h.check(), {"token-reuse": 1})

    def test_grant_answered_while_the_holder_is_still_entitled(self):
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1, ttl=1000)  # entitled until 1.0
        h.grant("b", "k", 2, 0.5, 0.9, ttl=1000)  # answered at 0.9: a's grant was lost
        self.assertEqual(h.check(), {"lost-grant": 1})

    def test_a_renewed_grant_is_lost_until_the_renewal_ends(self):
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1, ttl=1000)
        h.lease_op("renew", "a", "k", 1, 0.8, 0.82)  # entitled until 1.8
        h.lease_op("renew", "a", "k", 1, 1.5, 1.6, st=410)  # a failed renew extends nothing
        h.grant("b", "k", 2, 1.2, 1.7, ttl=1000)
        self.assertEqual(h.check(), {"lost-grant": 1})

    def test_an_answer_past_its_own_ttl_entitles_to_nothing(self):
        h = History()
        h.grant("a", "k", 2, 0.0, 0.1, ttl=1000)
        h.grant("b", "k", 1, 0.0, 0.5, ttl=300)  # waited past its TTL: already over when answered
        h.lease_op("renew", "b", "k", 1, 0.5, 0.52, st=410)
        self.assertEqual(h.check(), {})
        h.lease_op("renew", "b", "k", 1, 0.6, 0.62)  # but a successful renew says b held it
        self.assertEqual(h.check(), {"lost-grant": 1})

    def test_grants_after_a_release_or_the_ttl_are_not_lost(self):
        h = History()
        h.grant("a", "k", 1, 0.0, 0.1, ttl=1000)
        h.lease_op("release", "a", "k", 1, 0.4, 0.45)
        h.grant("b", "k", 2, 0.3, 0.45, ttl=1000)  # answered after a's release was sent
        h.grant("c", "k", 3, 0.5, 1.5, ttl=300)  # b's TTL (from 0.3) ran out at 1.3
        h.grant("d", "j", 4, 0.0, 0.2, ttl=5000)  # another key
        h.grant("e", "k", 5, 1.0, 1.81, ttl=300)  # c's TTL from its send time: 0.8
        self.assertEqual(h.check(), {})

    def test_token_lower_than_an_earlier_answered_grant(self):
        h = clean()
        h.grant("c", "j", 5, 0.0, 0.1)
        h.grant("d", "j", 3, 0.2, 0.3)  # asked after token 5 was answered, yet lower
        self.assertEqual(h.check(), {"grant-order": 1})

    def test_acknowledged_write_missing_from_the_log(self):
        h = clean()
        h.write("b", "k", 2, "b:2", "b:1", 1.3, 1.35)  # 200, never applied
        self.assertEqual(h.check(), {"lost-ack": 1})

    def test_write_not_derived_from_the_latest_value(self):
        h = clean()
        h.write("b", "k", 2, "b:2", "a:1", 1.3, 1.35, apply_at=1.32)  # derived from a stale read
        self.assertEqual(h.check(), {"lost-update": 1})

    def test_applied_token_nobody_was_granted(self):
        h = clean()
        h.apply("k", 3, value("x:1", "b:1", 3), 1.5)
        self.assertEqual(h.check(), {"ungranted-token": 1})

    def test_read_of_a_value_never_applied(self):
        h = clean()
        h.read("b", "k", 2, "ghost:1", 1.3, 1.31)
        self.assertEqual(h.check(), {"phantom-read": 1})

    def test_no_grant_and_write_within_the_bound_after_a_fault(self):
        h = clean()
        h.faults.append({"kind": "gateway-kill", "start": 1.5, "end": 2.0})
        h.grant("a", "k", 3, 6.5, 6.6)  # 4.6 s after the fault ended: bound is 4 s
        h.write("a", "k", 3, "a:2", "b:1", 6.7, 6.8, apply_at=6.75)
        self.assertEqual(h.check(), {"liveness": 1})

    def test_recovery_within_the_bound_is_live(self):
        h = clean()
        h.faults.append({"kind": "gateway-kill", "start": 1.5, "end": 2.0})
        h.grant("a", "k", 3, 2.1, 2.6)
        h.write("a", "k", 3, "a:2", "b:1", 2.7, 2.8, apply_at=2.75)
        self.assertEqual(h.check(), {})

    def test_fault_cut_short_by_the_next_one_is_not_judged(self):
        h = clean()
        h.faults.append({"kind": "pause", "start": 1.5, "end": 2.0})
        h.faults.append({"kind": "gateway-kill", "start": 3.0, "end": 10.0})  # within 4 s of the first's end
        h.grant("a", "k", 3, 10.1, 10.2)
        h.write("a", "k", 3, "a:2", "b:1", 10.3, 10.4, apply_at=10.35)
        self.assertEqual(h.check(), {})

    def test_process_that_died_on_its_own(self):
        h = clean()
        h.run["unexpected_exits"] = [{"process": "gateway", "code": 101, "at": 1.0}]
        self.assertEqual(h.check(), {"process-crash": 1})


if __name__ == "__main__":
    unittest.main()
