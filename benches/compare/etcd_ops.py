#!/usr/bin/env python3
"""etcd's own counters, for the etcd round trips per lock cycle (part 6).

    etcd_ops.py snap URL [URL ...]   -> one JSON object of counters, summed over the members
    etcd_ops.py diff BEFORE AFTER    -> AFTER - BEFORE (JSON objects as printed by snap)

Counters: gRPC calls handled, by method (unary calls: Range, Txn, Put,
DeleteRange, LeaseGrant, LeaseRevoke, Lock, Unlock, ...), gRPC stream
messages received, by method (LeaseKeepAlive, Watch), and the raft
proposals committed (the highest member's, every member commits the same).
"""
import json
import re
import sys
import urllib.request

LINE = re.compile(r'^(\w+)\{([^}]*)\}\s+([0-9.e+]+)$')


def labels(s):
    return dict(re.findall(r'(\w+)="([^"]*)"', s))


def snap(urls):
    out = {}
    proposals = 0.0
    for url in urls:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("etcd_server_proposals_committed_total "):
                proposals = max(proposals, float(line.split()[1]))
                continue
            m = LINE.match(line)
            if not m:
                continue
            name, lab, val = m.group(1), labels(m.group(2)), float(m.group(3))
            if name == "grpc_server_handled_total" and lab.get("grpc_type") == "unary":
                k = "rpc." + lab.get("grpc_method", "?")
            elif name == "grpc_server_msg_received_total" and lab.get("grpc_type") == "bidi_stream":
                k = "stream_msg." + lab.get("grpc_method", "?")
            elif name == "grpc_server_started_total" and lab.get("grpc_type") == "bidi_stream":
                k = "stream_open." + lab.get("grpc_method", "?")
            else:
                continue
            out[k] = out.get(k, 0.0) + val
    out["raft.proposals_committed"] = proposals
    return out


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "snap":
        print(json.dumps(snap(sys.argv[2:])))
    elif len(sys.argv) == 4 and sys.argv[1] == "diff":
        a, b = json.loads(sys.argv[2]), json.loads(sys.argv[3])
        d = {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b))}
        print(json.dumps({k: v for k, v in d.items() if v}))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
