"""Bucket latency on loopback: publish → visible to another peer, and publish/fetch call times, for N peers.

For each swarm size N, one process holds a writer and a reader swarm peer; N - 2 more peers run as separate
processes and hold their share of the DHT. Each trial publishes one inline group (G = 8, 6 tokens each) from the
writer and polls the reader until it sees it::

    python -m peer.bench.buckets --peers 2 8 32 --trials 40 --out buckets.json

Reported per N: p50/p95 of publish→visible, of the publish call, and of one fetch of the bucket.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

RUN = "bench-buckets"


def _group(peer_id: str, seq: int):
    from peer.protocol import Completion, GroupRecord, encode_tokens

    return GroupRecord(
        version=0,
        adapter_sha256=hashlib.sha256(b"v0").hexdigest(),
        producer=peer_id,
        seq=seq,
        task_seed=0,
        task_index=seq,
        prompt_ids=encode_tokens(list(range(1, 10))),
        completions=[Completion.of([5, 6, 7, 8, 9, 2], [-0.1] * 6) for _ in range(8)],
        rewards=[float(i % 2) for i in range(8)],
        created=time.time(),
    )


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def measure(n_peers: int, trials: int) -> dict:
    from peer.network.buckets import DHTBucketStore
    from peer.network.swarm import NetworkConfig, join

    writer = join(NetworkConfig.loopback(), RUN)
    procs = []
    try:
        first = writer.visible_maddrs()
        for _ in range(n_peers - 2):
            p = subprocess.Popen(
                [sys.executable, "-m", "peer.bench.idle_peer", RUN, *first],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
        for p in procs:
            p.stdout.readline()  # joined
        reader = join(NetworkConfig.loopback(first), RUN)
        try:
            w, r = DHTBucketStore(writer), DHTBucketStore(reader)
            visible, publish, fetch = [], [], []
            for seq in range(trials):
                group = _group(str(writer.peer_id), seq)
                t0 = time.perf_counter()
                w.publish(group)
                t1 = time.perf_counter()
                while True:
                    t2 = time.perf_counter()
                    got = r.fetch(0, 0)
                    t3 = time.perf_counter()
                    if any(f.seq == seq and f.group is not None for f in got):
                        break
                    if t3 - t0 > 30:
                        raise RuntimeError(f"group {seq} not visible after 30 s with {n_peers} peers")
                publish.append(t1 - t0)
                fetch.append(t3 - t2)
                visible.append(t3 - t0)
            return {
                "peers": n_peers,
                "trials": trials,
                **{f"visible_{k}_ms": round(1000 * _pct(visible, q), 1) for k, q in (("p50", 0.5), ("p95", 0.95))},
                **{f"publish_{k}_ms": round(1000 * _pct(publish, q), 1) for k, q in (("p50", 0.5), ("p95", 0.95))},
                **{f"fetch_{k}_ms": round(1000 * _pct(fetch, q), 1) for k, q in (("p50", 0.5), ("p95", 0.95))},
                "fetch_mean_ms": round(1000 * statistics.mean(fetch), 1),
            }
        finally:
            reader.shutdown()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        writer.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [measure(n, args.trials) for n in args.peers]
    cols = [
        "peers",
        "visible_p50_ms",
        "visible_p95_ms",
        "publish_p50_ms",
        "publish_p95_ms",
        "fetch_p50_ms",
        "fetch_p95_ms",
    ]
    print(" ".join(f"{c:>15}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>15}" for c in cols))
    base = rows[0]["visible_p50_ms"]
    result = {"rows": rows, "ratio_p50_largest_vs_smallest": round(rows[-1]["visible_p50_ms"] / base, 2)}
    print(
        f"publish→visible p50 at {rows[-1]['peers']} peers / at {rows[0]['peers']}: "
        f"{result['ratio_p50_largest_vs_smallest']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
