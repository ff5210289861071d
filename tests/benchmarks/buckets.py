"""Bucket latency on loopback: publish → visible to another peer, and publish/fetch call times, for N peers.

For each swarm size N, one process holds a writer and a reader swarm peer; N - 2 more peers run as separate
processes and hold their share of the DHT. Each trial publishes one inline group (G = 8, 6 tokens each) from the
writer and polls the reader until it sees it. Trials go round 32 versions, as a run's versions do: each version's
bucket has its own key and so its own nearest nodes (with one key, whether the writer or reader happened to be
one of them decided a whole run's numbers)::

    python -m tests.benchmarks.buckets --peers 2 8 32 --trials 40 --rounds 3 --out buckets.json

Every size is measured ``--rounds`` times, the sizes taking turns, and the ratio of the largest swarm's p50 to the
smallest's is taken within each round (the shared machine's speed drifts by 2x over minutes). Reported per N:
p50/p95 of publish→visible, of the publish call, and of one fetch of the bucket, for the narrow search the buckets
use and for hivemind's default (wide) search, in turns of 10 trials (a wide store's other replicas are written in
the background and would slow a narrow trial right after it). Readers pass the ids they have seen, as learners do.
What is measured is a swarm that is running, not one starting: after the last peer joins the bench waits
``--settle`` seconds (the just-started peers keep ~1.3 of the 2 cores busy for about 3 s, then ~0.1) and runs
``--warmup`` trials it does not count (the first requests to each peer open its connections).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

RUN = "bench-buckets"
VERSIONS = 32  # trials go round this many versions: each has its own bucket key, so its own nearest nodes
SEARCHES = ("push", "narrow", "wide")
BLOCK = 10  # trials in a row with one search; the two searches take turns block by block


def _group(peer_id: str, seq: int, version: int):
    from peer.protocol import Completion, GroupRecord, encode_tokens

    return GroupRecord(
        version=version,
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


def measure(n_peers: int, trials: int, settle: float = 5.0, warmup: int = 5) -> dict:
    from peer.network.buckets import NETWORK_EVERY, DHTBucketStore
    from peer.network.swarm import NetworkConfig, join

    writer = join(NetworkConfig.loopback(), RUN)
    procs = []
    try:
        first = writer.visible_maddrs()
        for _ in range(n_peers - 2):
            p = subprocess.Popen(
                [sys.executable, "-m", "tests.benchmarks.idle_peer", RUN, *first],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
        for p in procs:
            p.stdout.readline()  # joined
        reader = join(NetworkConfig.loopback(first), RUN)
        try:
            time.sleep(settle)
            stores = {
                "push": (
                    DHTBucketStore(writer, push_to=lambda: (str(reader.peer_id),)),
                    DHTBucketStore(reader, network_every=NETWORK_EVERY),
                ),
                "narrow": (DHTBucketStore(writer), DHTBucketStore(reader)),
                "wide": (DHTBucketStore(writer, narrow=False), DHTBucketStore(reader, narrow=False)),
            }
            times = {search: {"visible": [], "publish": [], "fetch": []} for search in stores}
            seqs, seen = itertools.count(), set()
            for block in range(len(SEARCHES) * math.ceil(trials / BLOCK)):
                search = SEARCHES[block % len(SEARCHES)]
                w, r = stores[search]
                time.sleep(1.0)  # a wide store's other replicas finish in the background; not into the next block
                for trial in range((warmup if block < len(SEARCHES) else 0) + BLOCK):
                    seq = next(seqs)
                    t0 = time.perf_counter()
                    version = seq % VERSIONS
                    w.publish(_group(str(writer.peer_id), seq, version))
                    t1 = time.perf_counter()
                    while True:
                        t2 = time.perf_counter()
                        got = r.fetch(version, version, seen=seen)
                        t3 = time.perf_counter()
                        seen.update(f.id for f in got if f.group is not None)
                        if (writer.public_key, version, seq) in seen:
                            break
                        if t3 - t0 > 30:
                            raise RuntimeError(f"group {seq} not visible after 30 s with {n_peers} peers")
                    if trial >= (warmup if block < len(SEARCHES) else 0):
                        for name, value in (("publish", t1 - t0), ("fetch", t3 - t2), ("visible", t3 - t0)):
                            times[search][name].append(value)
            row = {"peers": n_peers, "trials": trials}
            for search, measured in times.items():
                for name, values in measured.items():
                    for k, q in (("p50", 0.5), ("p95", 0.95)):
                        row[f"{search}_{name}_{k}_ms"] = round(1000 * _pct(values, q), 1)
            return row
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
    parser.add_argument("--rounds", type=int, default=3, help="times every size is measured, sizes taking turns")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between the last join and the first trial")
    parser.add_argument("--warmup", type=int, default=5, help="trials run first and not counted")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = [[measure(n, args.trials, args.settle, args.warmup) for n in args.peers] for _ in range(args.rounds)]
    names = [f"{name}_{k}" for name in ("visible", "publish", "fetch") for k in ("p50", "p95")]
    print(f"{'round':>5} {'peers':>5} {'search':>6} " + " ".join(f"{n + '_ms':>15}" for n in names))
    for r, rows in enumerate(rounds):
        for row in rows:
            for search in SEARCHES:
                cells = " ".join(f"{row[f'{search}_{n}_ms']:>15}" for n in names)
                print(f"{r:>5} {row['peers']:>5} {search:>6} {cells}")
    result = {"rounds": rounds}
    small, large = args.peers[0], args.peers[-1]
    for search in SEARCHES:
        # each round's largest swarm against its smallest, measured minutes apart at most (the machine drifts)
        ratios = [
            round(rows[-1][f"{search}_visible_p50_ms"] / rows[0][f"{search}_visible_p50_ms"], 2) for rows in rounds
        ]
        result[f"{search}_ratios_p50_largest_vs_smallest"] = ratios
        result[f"{search}_ratio_median"] = statistics.median(ratios)
        print(
            f"{search}: publish→visible p50 at {large} peers / at {small}, per round: {ratios}, "
            f"median {statistics.median(ratios)}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
