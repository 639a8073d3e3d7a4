#!/usr/bin/env python3
"""Turns run.sh's raw measurements (JSON lines) into one Markdown report.

usage: report.py RESULTS.jsonl META.json > REPORT.md

Every figure is a median over the interleaved repetitions, with the
[min-max] range; ratios are ratios of medians, with the range of the
per-repetition ratios (runs of one repetition are adjacent in time).
"""
import json
import statistics
import sys
from collections import defaultdict


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rng(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{fmt(med(xs))} [{fmt(min(xs))}–{fmt(max(xs))}]" if len(xs) > 1 else fmt(xs[0])


def k(x):
    return "–" if x is None else (f"{x / 1000:.1f} k" if x >= 1000 else f"{x:.0f}")


def ms(us):
    return "–" if us is None else f"{us / 1000:.2f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def rx(x):
    return "–" if x is None else f"{x:.2f}×"


def per_rep(num, den):
    """the ratio of each repetition measured for both"""
    return [num[i] / den[i] for i in num if i in den and den[i] and num[i] is not None]


def paired(num, den):
    """median of the per-repetition ratios: repetition i of both targets ran
    back to back, so noise that hits the machine for a while hits both"""
    return med(per_rep(num, den))


def ratio_cell(num, den):
    """ratio of medians, with the range of per-rep ratios"""
    r = ratio(med(num.values()), med(den.values()))
    per = per_rep(num, den)
    if r is None:
        return "–", None
    if len(per) > 1:
        return f"{rx(r)} [{min(per):.2f}–{max(per):.2f}]", r
    return rx(r), r


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    meta = json.load(open(sys.argv[2]))
    out = []
    w = out.append
    problems = []

    def errors_of(r):
        m = r.get("m", {})
        if m.get("failed"):
            return "failed"
        n = sum(m.get(f, 0) or 0 for f in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
        n += m.get("errors", 0) or 0
        return n

    for r in rows:
        e = errors_of(r)
        if e:
            problems.append(f"{r.get('part')} {r.get('target', r.get('load', ''))} "
                            f"conns/clients={r.get('conns', r.get('clients', r.get('n', '')))} rep {r.get('rep')}: "
                            f"{e} errors {r['m'].get('first_error') or ''}")

    w(f"# fencegate side by side ({meta['mode']} run)")
    w("")
    w(f"- command: `{meta['command']}`")
    w(f"- date: {meta['date']}")
    w(f"- machine: {meta['machine']}")
    w(f"- CPU placement: {meta['placement']}")
    w(f"- versions: {meta['versions']}")
    w(f"- the rest of the machine: before the run, other processes kept the CPUs busy {meta.get('baseline', '?')}; "
      f"load average {meta.get('load_start', '?')} at the start, {meta.get('load_end', '?')} at the end")
    if meta.get("fsync"):
        w(f"- the disk: an `fdatasync` of a 4 KiB append in the run's work directory takes {meta['fsync']} "
          f"(200 in a row, before the run); the durable lock figures (part 3) move with it, fencegate's and "
          f"Redis's alike but not in the same proportion: where it is cheap, both are bound by CPU per cycle")
    w(f"- method: every measurement repeated {meta['reps']}× (lock service and 64 MiB: "
      f"{'3' if meta['mode'] == 'full' else meta['reps']}×, restart: 3×), interleaved across targets "
      f"(A B C D A B C D …); figures are medians [min–max]; ratios are ratios of medians "
      f"[range of the per-repetition ratios]; the targets' verdicts use the median of the per-repetition "
      f"ratios (repetition i of two targets ran back to back, so a noisy stretch of the machine hits both), "
      f"shown there next to the ratio of medians. Runs: {meta['d_proxy']} s (proxy), {meta['d_big']} s (64 MiB), "
      f"{meta['d_lock']} s (locks), {meta['d_scale']} s (scale). Build {meta['build_s']} s, measurements {meta['run_s']} s.")
    w("- all proxies: one worker/thread on one CPU, access logs off (fencegate `--log-level warn`), "
      "upstream keep-alive; the backend for all is nginx `return 200` with one worker.")
    w("")
    if meta.get("only_cluster"):
        cluster_section(rows, meta, w)
        return finish(out, problems)

    # ------------------------------------------------------------ part 1
    proxy = [r for r in rows if r["part"] == "proxy"]
    targets = ["direct", "nginx", "haproxy", "fencegate"]
    conns = sorted({r["conns"] for r in proxy})
    cpu_med = {}
    by = defaultdict(dict)  # (target, conns) -> rep -> row
    for r in proxy:
        by[(r["target"], r["conns"])][r["rep"]] = r
    w("## 1. Proxy path: PUT, 1 KiB body, live `X-Fencing-Token`, keep-alive (wrk, 1 thread)")
    w("")
    w("| conns | target | requests/s | p50 ms | p99 ms | CPU µs per request, target process (user + kernel) | target's share of its core % | busy % load core / target core |")
    w("|---|---|---|---|---|---|---|---|")
    for c in conns:
        for t in targets:
            reps = by.get((t, c), {})
            if not reps:
                continue
            rps = [x["m"].get("rps") for x in reps.values()]
            p50 = [x["m"].get("p50_us") for x in reps.values()]
            p99 = [x["m"].get("p99_us") for x in reps.values()]
            cpu = [x["cpu"]["sut_cpu_s"] * 1e6 / x["m"]["requests"] for x in reps.values() if x["m"].get("requests")]
            usr = med([x["cpu"].get("sut_user_s", 0) * 1e6 / x["m"]["requests"] for x in reps.values() if x["m"].get("requests")])
            sys_ = med([x["cpu"].get("sut_sys_s", 0) * 1e6 / x["m"]["requests"] for x in reps.values() if x["m"].get("requests")])
            lb = med([x["cpu"].get("load_busy_pct") for x in reps.values()])
            sb = med([x["cpu"].get("sut_busy_pct") for x in reps.values()])
            share = med([100 * x["cpu"]["sut_cpu_s"] / (x["m"]["duration_us"] / 1e6)
                         for x in reps.values() if x["m"].get("duration_us")])
            cpu_med[(t, c)] = med(cpu)
            name = "direct to backend" if t == "direct" else t
            w(f"| {c} | {name} | {rng(rps, k)} | {ms(med(p50))} | {rng(p99, ms)} | "
              f"{'–' if not cpu else f'{med(cpu):.1f} ({usr:.1f} + {sys_:.1f})'} | {'–' if share is None else f'{share:.0f}'} | "
              f"{'–' if lb is None else f'{lb:.0f}'} / {'–' if sb is None else f'{sb:.0f}'} |")
    w("")
    w("fencegate's ratios (requests/s; p99 as fencegate ÷ other, lower is better):")
    w("")
    w("| conns | ÷ direct | ÷ nginx | ÷ HAProxy | p99 ÷ nginx's p99 | p99 ÷ HAProxy's p99 | CPU per request ÷ nginx's | ÷ HAProxy's |")
    w("|---|---|---|---|---|---|---|---|")
    target_rows = {}
    for c in conns:
        fg = {i: x["m"].get("rps") for i, x in by.get(("fencegate", c), {}).items()}
        fg99 = {i: x["m"].get("p99_us") for i, x in by.get(("fencegate", c), {}).items()}
        cells = []
        for t in ["direct", "nginx", "haproxy"]:
            other = {i: x["m"].get("rps") for i, x in by.get((t, c), {}).items()}
            cell, r = ratio_cell(fg, other)
            cells.append(cell)
            target_rows[("rps", t, c)] = (r, paired(fg, other))
        for t in ["nginx", "haproxy"]:
            other = {i: x["m"].get("p99_us") for i, x in by.get((t, c), {}).items()}
            cell, r = ratio_cell(fg99, other)
            cells.append(cell)
            target_rows[("p99", t, c)] = (r, paired(fg99, other))
        for t in ["nginx", "haproxy"]:
            cells.append(rx(ratio(cpu_med.get(("fencegate", c)), cpu_med.get((t, c)))))
        w(f"| {c} | " + " | ".join(cells) + " |")
    w("")

    # ------------------------------------------------------------ part 2
    big = [r for r in rows if r["part"] == "big"]
    bby = defaultdict(dict)
    for r in big:
        bby[(r["target"], r["conns"])][r["rep"]] = r
    w("## 2. Large bodies: 64 MiB PUTs streamed (loadgen bigput: body generated, never buffered by the client; "
      "backend: `loadgen sink`, reads every body to its end before answering 200)")
    w("")
    w("| conns | target | MiB/s | median s per PUT | peak RSS of the proxy process during the runs | CPU s per GiB (target process) |")
    w("|---|---|---|---|---|---|")
    for c in sorted({r["conns"] for r in big}):
        for t in ["direct-sink", "nginx-stream", "fencegate-big"]:
            reps = bby.get((t, c), {})
            if not reps:
                continue
            mibs = [x["m"].get("mib_per_s") for x in reps.values()]
            per = med([x["m"].get("median_request_s") for x in reps.values()])
            hwm = max(x["peak_rss_kib"] for x in reps.values())
            base = min(x["rss_before_kib"] for x in reps.values())
            gib = [x["cpu"]["sut_cpu_s"] / (x["m"]["bytes"] / 2**30) for x in reps.values() if x["m"].get("bytes")]
            name = {"direct-sink": "direct to the sink backend", "nginx-stream": "nginx (`proxy_request_buffering off`)",
                    "fencegate-big": "fencegate"}.get(t, t)
            rss = "–" if t == "direct-sink" else f"{hwm / 1024:.1f} MiB (idle before: {base / 1024:.1f} MiB)"
            w(f"| {c} | {name} | {rng(mibs, lambda v: f'{v:.0f}')} | {per:.3f} | {rss} | "
              f"{'–' if not gib else f'{med(gib):.2f}'} |")
    w("")
    w("| conns | fencegate ÷ nginx (MiB/s) | fencegate ÷ direct | fencegate peak RSS |")
    w("|---|---|---|---|")
    for c in sorted({r["conns"] for r in big}):
        fg = {i: x["m"].get("mib_per_s") for i, x in bby.get(("fencegate-big", c), {}).items()}
        ng = {i: x["m"].get("mib_per_s") for i, x in bby.get(("nginx-stream", c), {}).items()}
        di = {i: x["m"].get("mib_per_s") for i, x in bby.get(("direct-sink", c), {}).items()}
        cell, r = ratio_cell(fg, ng)
        cell2, _ = ratio_cell(fg, di)
        peak = max((x["peak_rss_kib"] for x in bby.get(("fencegate-big", c), {}).values()), default=None)
        target_rows[("big", c)] = (r, paired(fg, ng))
        target_rows[("bigrss", c)] = peak
        w(f"| {c} | {cell} | {cell2} | {'–' if peak is None else f'{peak / 1024:.1f} MiB'} |")
    w("")

    # ------------------------------------------------------------ part 3
    lock = [r for r in rows if r["part"] == "lock"]
    lby = defaultdict(dict)
    for r in lock:
        lby[(r["op"], r["target"], r["clients"])][r["rep"]] = r
    systems = ["fencegate", "redis-always", "redis-none", "etcd"]
    names = {
        "fencegate": "fencegate (durable: fsync, group commit)",
        "redis-always": "Redis `SET NX PX` + Lua CAD, `appendfsync always`",
        "redis-none": "Redis, same, `appendonly no` (not durable)",
        "etcd": "etcd (lease + `If(create_revision==0)` txn + delete)",
    }
    w("## 3. Lock service: closed loop, one connection per client, each client its own key (loadgen lock)")
    w("")
    w("A cycle is acquire + release. fencegate: `POST /v1/locks/acquire` + `/release` (the grant is fsynced "
      "before it is answered; the release rides the next fsync). Redis: `SET k v NX PX 30000` + "
      "`EVALSHA` compare-and-delete. etcd (JSON gateway): one session lease per client granted before the run, "
      "then txn `If(create_revision(k)==0) Then Put(k, v, lease)` + `deleterange`. A renewal is fencegate "
      "`/v1/locks/renew` (memory only), Redis Lua compare-and-`PEXPIRE`, etcd `/v3/lease/keepalive`. "
      "Cells: operations/s, median [min–max]; the median p99 latency; the server process's CPU time per "
      "operation; how busy the server's core was (100% = CPU-bound; lower = waiting, e.g. on fsync).")
    w("")
    for op in ["cycle", "renew"]:
        cl = sorted({r["clients"] for r in lock if r["op"] == op})
        if not cl:
            continue
        w(f"| {'acquire + release cycles/s' if op == 'cycle' else 'renewals/s'} | "
          + " | ".join(f"{c} client{'s' if c > 1 else ''}" for c in cl) + " |")
        w("|---|" + "---|" * len(cl))
        for s in systems:
            cells = []
            for c in cl:
                reps = lby.get((op, s, c), {})
                v = [x["m"].get("ops_per_s") for x in reps.values()]
                p99 = med([x["m"].get("p99_us") for x in reps.values()])
                cpu = med([x["cpu"]["sut_cpu_s"] * 1e6 / x["m"]["ops"] for x in reps.values() if x["m"].get("ops")])
                busy = med([x["cpu"].get("sut_busy_pct") for x in reps.values()])
                cells.append(f"{rng(v, k)} (p99 {ms(p99)} ms; {'–' if cpu is None else f'{cpu:.0f}'} µs CPU/op; "
                             f"core {'–' if busy is None else f'{busy:.0f}'}% busy)")
            w(f"| {names[s]} | " + " | ".join(cells) + " |")
        for other in ["redis-always", "redis-none", "etcd"]:
            cells = []
            for c in cl:
                fg = {i: x["m"].get("ops_per_s") for i, x in lby.get((op, "fencegate", c), {}).items()}
                ot = {i: x["m"].get("ops_per_s") for i, x in lby.get((op, other, c), {}).items()}
                cell, r = ratio_cell(fg, ot)
                target_rows[("lock", op, other, c)] = (r, paired(fg, ot))
                cells.append(cell)
            w(f"| fencegate ÷ {other} | " + " | ".join(cells) + " |")
        w("")

    # ------------------------------------------------------------ part 4
    scale = [r for r in rows if r["part"] == "scale"]
    restart = [r for r in rows if r["part"] == "restart"]
    prefill = {r["n"]: r["m"] for r in rows if r["part"] == "prefill"}
    leases = [r for r in rows if r["part"] == "leases"]
    ns = sorted({r["n"] for r in scale} | {r["n"] for r in restart})
    sby = defaultdict(dict)
    for r in scale:
        sby[(r["load"], r["n"])][r["rep"]] = r
    rby = defaultdict(list)
    for r in restart:
        rby[r["n"]].append(r["m"])
    w(f"## 4. Scale: fencegate with N random keys in the fence table ({meta['scale_conns']} connections)")
    w("")
    w("Hot: fenced PUTs (1 KiB) to one key with a live grant (strict route, as in part 1). Random: PUTs to a "
      "random key of the N (route with `fence_authority = \"external\"`, token equal to the fence, so "
      "admitted without a write). The table holds the N keys plus the hot key. Restart: SIGTERM, then "
      "start to `/readyz` answering 200 (open RocksDB, rebuild the table, bind); RSS read 0.5 s after.")
    w("")
    w("| N | hot req/s | ÷ N=1 | hot p99 ms | random req/s | ÷ N=1 | random p99 ms | restart ms | table rebuild ms (log) | RSS after restart |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    base_hot = {i: x["m"].get("rps") for i, x in sby.get(("hot", ns[0]), {}).items()} if ns else {}
    base_rnd = {i: x["m"].get("rps") for i, x in sby.get(("random", ns[0]), {}).items()} if ns else {}
    rss_med = {}
    for n in ns:
        hot = {i: x["m"].get("rps") for i, x in sby.get(("hot", n), {}).items()}
        rnd = {i: x["m"].get("rps") for i, x in sby.get(("random", n), {}).items()}
        hc, hr = ratio_cell(hot, base_hot)
        rc, rr = ratio_cell(rnd, base_rnd)
        target_rows[("scale", "hot", n)] = hr
        target_rows[("scale", "random", n)] = rr
        hp99 = med([x["m"].get("p99_us") for x in sby.get(("hot", n), {}).values()])
        rp99 = med([x["m"].get("p99_us") for x in sby.get(("random", n), {}).values()])
        rs = rby.get(n, [])
        rms = [m["restart_ms"] for m in rs]
        reb = [m.get("rebuild_ms") for m in rs]
        rss_med[n] = med([m["rss_kib"] for m in rs])
        target_rows[("restart", n)] = med(rms)
        w(f"| {n:,} | {rng(list(hot.values()), k)} | {hc} | {ms(hp99)} | {rng(list(rnd.values()), k)} | {rc} | "
          f"{ms(rp99)} | {rng(rms, lambda v: f'{v:.0f}')} | {rng(reb, lambda v: f'{v:.0f}')} | "
          f"{'–' if rss_med[n] is None else f'{rss_med[n] / 1024:.1f} MiB'} |")
    w("")
    if len(ns) > 1 and rss_med.get(ns[0]) is not None:
        for n in ns[1:]:
            if rss_med.get(n) is not None:
                per = (rss_med[n] - rss_med[ns[0]]) * 1024 / (n - ns[0])
                target_rows[("perfence", n)] = per
                w(f"- memory per fence (RSS after restart, N={n:,} minus N={ns[0]:,}, ÷ the difference; "
                  f"includes RocksDB's memtable and caches): **{per:.0f} bytes**")
    for r in leases:
        m = r["m"]
        per = (m["rss_after_kib"] - m["rss_before_kib"]) * 1024 / max(m["leases"], 1)
        target_rows[("perlease",)] = per
        w(f"- memory per live lease ({m['leases']:,} leases acquired and held on keys that already had a fence, "
          f"N={r['n']:,}; RSS {m['rss_before_kib'] / 1024:.1f} → {m['rss_after_kib'] / 1024:.1f} MiB; includes the "
          f"grants' RocksDB memtable): **{per:.0f} bytes**; acquired at {m['hold'].get('per_s', 0):,.0f}/s with 64 clients")
    for n, m in sorted(prefill.items()):
        w(f"- prefill N={n:,}: {m.get('ok', 0):,} durable fence advances (external-route PUTs, 256 connections) "
          f"in {m.get('secs', 0):.1f} s = {m.get('per_s', 0):,.0f}/s")
    w("")

    # ------------------------------------------------------------ targets
    w("## Targets (issue 8)")
    w("")
    w("| target | measured | verdict |")
    w("|---|---|---|")

    def verdict(ok):
        return "–" if ok is None else ("**met**" if ok else "**missed**")

    def both(key, what=""):
        """(cell, paired ratio) of a ratio stored with its paired form"""
        r, p = target_rows.get(key, (None, None))
        return f"{what}{rx(p)} paired (ratio of medians {rx(r)})", p

    for c in conns:
        cell, r = both(("rps", "nginx", c))
        w(f"| fenced PUT ≥ 1.0× nginx requests/s at {c} connections | {cell} | {verdict(None if r is None else r >= 1.0)} |")
        cell, p = both(("p99", "nginx", c), "p99 ratio ")
        w(f"| … with p99 ≤ nginx's at {c} connections | {cell} | {verdict(None if p is None else p <= 1.0)} |")
    cell, r = both(("lock", "cycle", "redis-always", 64))
    w(f"| durable lock cycles/s ≥ Redis `appendfsync always` at 64 clients | {cell} | {verdict(None if r is None else r >= 1.0)} |")
    cell, r = both(("lock", "cycle", "etcd", 64))
    w(f"| durable lock cycles/s ≥ 5× etcd at 64 clients | {cell} | {verdict(None if r is None else r >= 5.0)} |")
    nmax = ns[-1] if ns else None
    full_scale = nmax is not None and nmax >= 1_000_000
    for load in ["hot", "random"]:
        r = target_rows.get(("scale", load, nmax))
        note = "" if full_scale else f" (smoke: largest N is {nmax:,})"
        w(f"| proxy throughput with 1,000,000 fences within 10% of 1 fence ({load} key{'s' if load == 'random' else ''})"
          f" | {rx(r)} at N={nmax:,}{note} | {verdict(None if r is None or not full_scale else r >= 0.9)} |")
    rm = target_rows.get(("restart", nmax))
    w(f"| restart with 1,000,000 fences < 2 s | {'–' if rm is None else f'{rm:.0f} ms'} at N={nmax:,} | "
      f"{verdict(None if rm is None or not full_scale else rm < 2000)} |")
    for c in sorted({r['conns'] for r in big}):
        cell, r = both(("big", c))
        peak = target_rows.get(("bigrss", c))
        w(f"| 64 MiB PUTs ≥ 0.9× nginx's throughput ({c} connection{'s' if c > 1 else ''}) | {cell} | {verdict(None if r is None else r >= 0.9)} |")
        w(f"| … fencegate peak RSS < 64 MiB ({c} connection{'s' if c > 1 else ''}) | "
          f"{'–' if peak is None else f'{peak / 1024:.1f} MiB'} | {verdict(None if peak is None else peak < 64 * 1024)} |")
    w("")
    cluster_section(rows, meta, w)
    return finish(out, problems)


def finish(out, problems):
    w = out.append
    if problems:
        w("## Problems seen during the run")
        w("")
        for p in problems:
            w(f"- {p}")
        w("")
    print("\n".join(out))
    return 3 if problems else 0


# etcd counters shown per lock cycle (etcd_ops.py), in this order.
ETCD_OPS = [
    ("rpc.LeaseGrant", "LeaseGrant"), ("rpc.Txn", "Txn"), ("rpc.Put", "Put"), ("rpc.Range", "Range"),
    ("rpc.DeleteRange", "DeleteRange"), ("rpc.LeaseRevoke", "LeaseRevoke"), ("rpc.Lock", "Lock"),
    ("rpc.Unlock", "Unlock"), ("stream_open.LeaseKeepAlive", "KeepAlive streams opened"),
    ("stream_msg.LeaseKeepAlive", "KeepAlive requests"), ("raft.proposals_committed", "raft proposals"),
]


def cluster_section(rows, meta, w):
    """part 6: cluster mode against etcd's own lock, on one 3-member etcd"""
    cl = [r for r in rows if r["part"] == "cluster"]
    puts = [r for r in rows if r["part"] == "cluster-put"]
    if not cl and not puts:
        return
    by = defaultdict(dict)
    for r in cl:
        by[(r["kind"], r["target"])][r["rep"]] = r
    names = {
        "fencegate-3gw": "fencegate, 3 gateways (client i on gateway i mod 3)",
        "fencegate-1gw": "fencegate, 1 gateway",
        "fencegate-3gw-on-gw1": "fencegate, 3 gateways (client on gw1)",
        "etcd-lock": "etcd v3lock `Lock`/`Unlock` (gRPC, session lease per client)",
        "etcd-txn": "etcd txn `If(create_revision==0) Put(k, lease)` + `Delete` (gRPC, session lease per client)",
    }
    w("## 6. Cluster mode: the same 3-member etcd cluster, fencegate gateways vs etcd's own lock")
    w("")
    w("3 etcd members, the gateways and a single-node gateway on the server core, the load generator on the "
      "other. A cycle is acquire + release of a key of the client's own (64 clients, closed loop). "
      "fencegate clients talk HTTP to the gateways; etcd clients talk gRPC (etcd-client) to member i mod 3, "
      "each with a session lease granted before the run. Cells: median [min–max] over "
      f"{meta.get('cluster_reps', '?')} interleaved repetitions of {meta.get('d_cluster', '?')} s. etcd calls per "
      "cycle: etcd's own counters (gRPC calls handled, all members) around the run ÷ cycles — the profile of "
      "where a cycle's etcd round trips go (the gateways' acknowledgements are Puts; watch deliveries are not counted).")
    w("")
    w("| 64 clients | cycles/s | cycle p50 / p99 ms | acquire p50 / p99 ms | etcd calls per cycle |")
    w("|---|---|---|---|---|")
    for t in ["fencegate-3gw", "fencegate-1gw", "etcd-lock", "etcd-txn"]:
        reps = by.get(("cycles", t), {})
        if not reps:
            continue
        v = [x["m"].get("ops_per_s") for x in reps.values()]
        p50 = med([x["m"].get("p50_us") for x in reps.values()])
        p99 = med([x["m"].get("p99_us") for x in reps.values()])
        a50 = med([x["m"].get("acquire_p50_us") for x in reps.values()])
        a99 = med([x["m"].get("acquire_p99_us") for x in reps.values()])
        per = []
        for key, label in ETCD_OPS:
            x = med([x.get("etcd_ops", {}).get(key, 0) / x["m"]["ops"] for x in reps.values() if x["m"].get("ops")])
            if x and x >= 0.01:
                per.append(f"{label} {x:.2f}")
        w(f"| {names[t]} | {rng(v, k)} | {ms(p50)} / {ms(p99)} | {ms(a50)} / {ms(a99)} | {'; '.join(per) or '–'} |")
    for fg in ["fencegate-3gw", "fencegate-1gw"]:
        for other in ["etcd-lock", "etcd-txn"]:
            a = {i: x["m"].get("ops_per_s") for i, x in by.get(("cycles", fg), {}).items()}
            b = {i: x["m"].get("ops_per_s") for i, x in by.get(("cycles", other), {}).items()}
            cell, _ = ratio_cell(a, b)
            w(f"| {fg} ÷ {other} | {cell} | | | |")
    w("")
    w("Grant latency, one client cycling (acquire alone; ms):")
    w("")
    w("| 1 client | acquire p50 | acquire p99 | cycle p50 | etcd calls per cycle |")
    w("|---|---|---|---|---|")
    for t in ["fencegate-3gw-on-gw1", "fencegate-1gw"]:
        reps = by.get(("latency", t), {})
        if not reps:
            continue
        a50 = [x["m"].get("acquire_p50_us") for x in reps.values()]
        a99 = [x["m"].get("acquire_p99_us") for x in reps.values()]
        c50 = [x["m"].get("p50_us") for x in reps.values()]
        per = []
        for key, label in ETCD_OPS:
            x = med([x.get("etcd_ops", {}).get(key, 0) / x["m"]["ops"] for x in reps.values() if x["m"].get("ops")])
            if x and x >= 0.01:
                per.append(f"{label} {x:.2f}")
        w(f"| {names[t]} | {rng(a50, ms)} | {rng(a99, ms)} | {rng(c50, ms)} | {'; '.join(per) or '–'} |")
    w("")
    pby = defaultdict(dict)
    for r in puts:
        pby[r["target"]][r["rep"]] = r
    w("Fenced PUTs, 1 KiB, 32 connections (wrk), to a cluster-mode gateway and to a single-node gateway "
      "(same binary, same route, same backend):")
    w("")
    w("| target | requests/s | p99 ms |")
    w("|---|---|---|")
    for t in ["cluster", "single"]:
        reps = pby.get(t, {})
        w(f"| {t} | {rng([x['m'].get('rps') for x in reps.values()], k)} | "
          f"{ms(med([x['m'].get('p99_us') for x in reps.values()]))} |")
    a = {i: x["m"].get("rps") for i, x in pby.get("cluster", {}).items()}
    b = {i: x["m"].get("rps") for i, x in pby.get("single", {}).items()}
    put_cell, _ = ratio_cell(a, b)
    w(f"| cluster ÷ single | {put_cell} | |")
    w("")
    w("### Targets (issue 15, performance)")
    w("")
    w("| target | measured (paired median [per-repetition range]) | verdict |")
    w("|---|---|---|")

    def pair(x, y, field="ops_per_s", kind="cycles", src=None):
        src = src or by
        a = {i: r["m"].get(field) for i, r in src.get((kind, x) if kind else x, {}).items()}
        b = {i: r["m"].get(field) for i, r in src.get((kind, y) if kind else y, {}).items()}
        per = per_rep(a, b)
        p = med(per)
        return p, ("–" if p is None else f"{p:.2f}× [{min(per):.2f}–{max(per):.2f}]")

    for other, what in [("etcd-lock", "etcd's v3lock Lock/Unlock"), ("etcd-txn", "the bare create-if-absent txn + delete")]:
        p, cell = pair("fencegate-3gw", other)
        w(f"| lock cycles/s through 3 cluster gateways ≥ 1.0× {what} (64 clients) | {cell} | "
          f"{'–' if p is None else ('**met**' if p >= 1.0 else '**missed**')} |")
    p, cell = pair("cluster", "single", field="rps", kind=None, src=pby)
    w(f"| fenced PUTs through a cluster gateway ≥ 0.95× single-node | {cell} | "
      f"{'–' if p is None else ('**met**' if p >= 0.95 else '**missed**')} |")
    for f, label in [("acquire_p50_us", "p50"), ("acquire_p99_us", "p99")]:
        p, cell = pair("fencegate-3gw-on-gw1", "fencegate-1gw", field=f, kind="latency")
        w(f"| grant latency {label}, 3 gateways ÷ 1 (1 client) | {cell} | reported |")
    w("")


if __name__ == "__main__":
    sys.exit(main())
