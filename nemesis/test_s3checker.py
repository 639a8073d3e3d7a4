#!/usr/bin/env python3
"""Unit tests of s3checker.py on hand-made histories and object files: each
check fires on the anomaly it names and stays quiet on a clean history.

    python3 -m unittest nemesis/test_s3checker.py
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s3checker  # noqa: E402

KEY = "nem/obj0"


class History:
    """A run directory: client records, faults, and the object files."""

    def __init__(self):
        self.ops, self.faults, self.final = [], [], {KEY: None}
        self.run = {"liveness_bound_s": 4.0, "stop_at": 1000.0, "mode": "test", "s3_bucket": "nem",
                    "s3_objects": [KEY]}

    def grant(self, c, token, t0, t1, key=KEY):
        self.ops.append({"ev": "acquire", "c": c, "key": key, "token": token, "t0": t0, "t1": t1, "st": 200})

    def op(self, ev, c, token, wid, t0, t1, st=200, code=None, prev=None, key=KEY, **kv):
        self.ops.append({"ev": ev, "c": c, "key": key, "token": token, "id": wid, "t0": t0, "t1": t1, "st": st,
                         "code": code, "prev": prev, **kv})

    def mpu(self, c, token, wid, t0, st_complete=200, code=None, part2_st=200):
        """An upload: create, part 1, part 2, complete, 0.1 s apart from t0."""
        self.op("mpu-create", c, token, wid, t0, t0 + 0.01)
        self.op("mpu-part", c, token, wid, t0 + 0.02, t0 + 0.03, part=1)
        self.op("mpu-part", c, token, wid, t0 + 0.2, t0 + 0.21, st=part2_st, code=code, part=2)
        if part2_st == 200:
            self.op("mpu-complete", c, token, wid, t0 + 0.3, t0 + 0.31, st=st_complete, code=code)

    def read(self, c, token, pairs, t0, t1, key=KEY):
        """A read that served the chain of (id, token) pairs."""
        self.ops.append({"ev": "read", "c": c, "key": key, "token": token, "t0": t0, "t1": t1, "st": 200,
                         "chain": [list(p) for p in pairs] or None})

    def lines(self, *pairs, key=KEY):
        """The object's final chain: (id, token) pairs in order."""
        prev, chain = None, []
        for wid, tok in pairs:
            chain.append({"id": wid, "t": tok, "op": "put", "prev": prev})
            prev = wid
        self.final[key] = chain

    def check(self, with_files=True):
        d = tempfile.mkdtemp(prefix="s3checker-test-")
        try:
            os.makedirs(os.path.join(d, "clients"))
            os.makedirs(os.path.join(d, "s3-data", "nem"))
            self.run["s3_data_dir"] = os.path.join(d, "s3-data")
            with open(os.path.join(d, "run.json"), "w") as f:
                json.dump(self.run, f)
            with open(os.path.join(d, "clients", "all.jsonl"), "w") as f:
                for o in self.ops:
                    f.write(json.dumps(o) + "\n")
            with open(os.path.join(d, "nemesis.jsonl"), "w") as f:
                for x in self.faults:
                    f.write(json.dumps(x) + "\n")
            for key, chain in self.final.items():
                if chain is None:
                    continue
                with open(os.path.join(d, "s3-data", key), "w") as f:
                    f.write(chain if isinstance(chain, str) else "".join(json.dumps(x) + "\n" for x in chain))
            return s3checker.check(d)
        finally:
            shutil.rmtree(d)


def clean():
    """A's put, B's upload on top of it, A's zombie refused."""
    h = History()
    h.grant("a", 10, 0.0, 0.01)
    h.op("put", "a", 10, "a:1", 0.1, 0.15)
    h.grant("b", 12, 2.0, 2.01)
    h.mpu("b", 12, "b:1", 2.1)
    h.op("put", "a", 10, "a:2", 2.6, 2.61, st=409, code="StaleFencingToken", prev="a:1")
    h.lines(("a:1", 10), ("b:1", 12))
    return h


def kinds(s):
    return s["anomalies_by_kind"]


class S3CheckerTest(unittest.TestCase):
    def test_clean_history_has_no_anomaly(self):
        s = clean().check()
        self.assertEqual(s["anomalies"], 0, s["anomaly_examples"])
        self.assertEqual((s["zombie_mutations"], s["zombie_refused"]), (1, 1))

    def test_zombie_put_acknowledged_overwriting_the_new_holder(self):
        # The GC pause in shadow mode: A wakes after B's grant and upload,
        # and its put of what it read before the pause is forwarded.
        h = clean()
        h.ops = [o for o in h.ops if o.get("id") != "a:2"]
        h.op("put", "a", 10, "a:2", 2.6, 2.61, prev="a:1")
        h.lines(("a:1", 10), ("a:2", 10))
        k = kinds(h.check())
        self.assertEqual(k.get("superseded-acked"), 1, k)
        self.assertEqual(k.get("lost-ack"), 1, k)  # B's upload is gone
        self.assertEqual(k.get("final-not-latest"), 1, k)

    def test_zombie_upload_part_acknowledged(self):
        h = History()
        h.grant("a", 10, 0.0, 0.01)
        h.op("mpu-create", "a", 10, "a:1", 0.1, 0.11)
        h.op("mpu-part", "a", 10, "a:1", 0.12, 0.13, part=1)
        h.grant("b", 12, 2.0, 2.01)
        h.op("mpu-part", "a", 10, "a:1", 2.5, 2.51, part=2)  # after B's grant, acknowledged
        self.assertEqual(kinds(h.check()).get("superseded-acked"), 1)

    def test_zombie_write_without_an_answer_found_in_the_object(self):
        h = clean()
        h.ops = [o for o in h.ops if o.get("id") != "a:2"]
        h.op("put", "a", 10, "a:2", 2.6, 2.7, st=None, prev="b:1")
        h.lines(("a:1", 10), ("b:1", 12), ("a:2", 10))
        k = kinds(h.check())
        self.assertEqual(k.get("superseded-applied"), 1, k)
        self.assertEqual(k.get("non-monotonic"), 1, k)
        self.assertEqual(k.get("final-not-latest"), 1, k)

    def test_stale_delete_removes_an_acknowledged_write(self):
        h = clean()
        h.read("a", 10, [("a:1", 10)], 0.2, 0.21)  # before its pause: B's upload is not there yet
        h.op("delete-objects", "a", 10, "a:3", 2.8, 2.81)
        h.final[KEY] = None
        k = kinds(h.check())
        self.assertEqual(k.get("superseded-acked"), 1, k)
        self.assertEqual(k.get("lost-ack"), 1, k)
        self.assertEqual(k.get("final-not-latest"), 1, k)

    def test_legitimate_delete_explains_a_missing_write(self):
        h = clean()
        h.read("b", 12, [("a:1", 10), ("b:1", 12)], 2.7, 2.71)
        h.op("delete", "b", 12, "b:2", 2.8, 2.81)
        h.final[KEY] = None
        self.assertEqual(h.check()["anomalies"], 0)

    def test_stale_write_seen_by_a_read_then_deleted(self):
        # The final file no longer shows it, but s3s-fs served it.
        h = clean()
        h.ops = [o for o in h.ops if o.get("id") != "a:2"]
        h.op("put", "a", 10, "a:2", 2.6, 2.7, st=None, prev="b:1")
        h.read("b", 12, [("a:1", 10), ("b:1", 12), ("a:2", 10)], 2.8, 2.81)
        h.op("delete", "b", 12, "b:2", 2.9, 2.91)
        h.final[KEY] = None
        k = kinds(h.check())
        self.assertEqual(k.get("superseded-applied"), 1, k)
        self.assertEqual(k.get("non-monotonic"), 1, k)
        self.assertNotIn("lost-ack", k)

    def test_duplicate_grant_and_ungranted_token(self):
        h = clean()
        h.grant("c", 12, 3.0, 3.01, key="nem/obj1")
        h.lines(("a:1", 10), ("b:1", 12), ("x:1", 99))
        k = kinds(h.check())
        self.assertEqual(k.get("duplicate-grant"), 1, k)
        self.assertEqual(k.get("ungranted-token"), 1, k)

    def test_torn_object_is_malformed(self):
        h = clean()
        h.final[KEY] = '{"id": "a:1", "t": 10}\n{"id": "b:1", "t'
        self.assertEqual(kinds(h.check()).get("malformed-object"), 1)

    def test_torn_body_served_to_a_read_is_malformed(self):
        h = clean()
        h.ops.append({"ev": "read", "c": "b", "key": KEY, "token": 12, "t0": 2.5, "t1": 2.51, "st": 200,
                      "err": "not a chain"})
        self.assertEqual(kinds(h.check()).get("malformed-object"), 1)

    def test_liveness_after_a_fault(self):
        h = clean()
        h.faults.append({"kind": "gateway-kill", "start": 5.0, "end": 5.5})
        self.assertEqual(kinds(h.check()).get("liveness"), 1)
        h.grant("c", 14, 6.0, 6.1)
        h.op("put", "c", 14, "c:1", 6.2, 6.3, prev="b:1")
        h.lines(("a:1", 10), ("b:1", 12), ("c:1", 14))
        s = h.check()
        self.assertEqual(s["anomalies"], 0, s["anomaly_examples"])


if __name__ == "__main__":
    unittest.main()
