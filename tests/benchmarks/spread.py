"""How adapter versions spread through a swarm as the number of rollout peers N grows: who uploads them.

For each N in ``--peers`` (one round after another), the demo's local swarm (:class:`tests.benchmarks.rollouts.Round`:
host, N rollout peers, 1 learner; real processes on loopback, one torch thread each; the host with
``--groups-per-version 24``) with every rollout peer paced at ``--batch-seconds`` (the benchmark knob
``--bench-batch-seconds S``, see :mod:`tests.benchmarks.rollouts`: 2 cores must hold N peers, so the default is 4 s).
Each round waits for the first version, ``--warmup`` s more, then measures ``--seconds``. Reported per N, from the
ledgers (the learner's: a line per version; each rollout peer's: its swap lines, with cumulative byte counters):

* **learner upload per version**: bytes the learner's blob server sent to other peers between the first and the last
  version of the window, per version in between, in adapter sizes. Target: <= 2 at every N (a learner that serves
  every peer itself uploads about N: the swarm's spreading must not grow the learner's upload with N).
* **rollout peers' traffic**: per peer, bytes served and fetched per version announced in the window (adapter sizes;
  counted between its swap lines, per version announced between them; fetched is about 1, less when a version is
  superseded before its fetch), and the sum over the rollout peers of served per version (how much of the
  spreading they did: about N - 1 when the learner serves ~1).
* **fetch**: announcement -> the blob in the peer's hands (its follower's ``fetched_at``), p50/p95 over the
  versions each peer took: how fast a version spreads, whatever the batch it waits for.
* **propagation** (:func:`tests.benchmarks.rollouts.propagation`): announcement -> swap, p50/p95 over (version, peer)
and
  the per-version last peer's p50: with paced batches this is mostly the wait for the running batch to end (half
  a batch on average), so compare it between codes at the same pacing, not with rollouts' unpaced target.
* versions/s in the window and the exit codes of the round's processes.

Counters a ledger lacks (an older build) are reported as None::

    python -m tests.benchmarks.spread --peers 2 4 8 --seconds 60 --out spread.json

Not a test: numbers depend on the machine; docs/benchmarks.md records runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tests.benchmarks.rollouts import Round, pct, propagation, sleep_until

os.environ.setdefault("OMP_NUM_THREADS", "1")


def window(versions: list[dict], start: float, end: float) -> list[dict]:
    return [v for v in versions if start <= v["time"] <= end]


def adapter_size(versions: list[dict], peers: dict[str, list[dict]]) -> int | None:
    """The adapter's size in bytes: the learner's newest line that has it, else any rollout peer's swap line."""
    mine = [v["size"] for v in versions if v.get("size")]
    theirs = (x["size"] for rows in peers.values() for x in rows if x.get("kind") == "swap" and x.get("size"))
    return mine[-1] if mine else next(theirs, None)


def upload_per_version(versions: list[dict], start: float, end: float, size: int | None = None) -> float | None:
    """The learner's served bytes per version in the window, in adapter sizes (``size``: when its lines lack one).

    None with fewer than 2 versions in the window, or without ``served_bytes`` at its first or last one."""
    inside = window(versions, start, end)
    if len(inside) < 2:
        return None
    first, last = inside[0].get("served_bytes"), inside[-1].get("served_bytes")
    size = inside[-1].get("size") or size
    if first is None or last is None or not size:
        return None
    return round((last - first) / (len(inside) - 1) / size, 4)


def counter_span(rows: list[dict], start: float, end: float) -> tuple[dict, dict] | None:
    """The two lines of a rollout peer's ledger that bound the window for its cumulative counters: the last swap at
    or before ``start`` (else its start line: a peer that joined inside the window, counters 0) and the last swap at
    or before ``end``; None if it made no swap in the window."""
    swaps = [x for x in rows if x.get("kind") == "swap" and x["time"] <= end]
    before = [x for x in swaps if x["time"] <= start]
    base = before[-1] if before else next((x for x in rows if x.get("kind") == "start"), None)
    if base is None or not swaps or swaps[-1] is base:
        return None
    return base, swaps[-1]


def peer_traffic(rows: list[dict], start: float, end: float, size: int | None) -> dict:
    """One rollout peer's bytes served and fetched over the window, in adapter sizes, per version announced between
    the two lines that bound it (:func:`counter_span`; not the window's own count: the versions announced near its
    end reach a peer after it, so their bytes are not in its counters yet). None where a counter is missing."""
    out = {"served_per_version": None, "fetched_per_version": None}
    span = counter_span(rows, start, end)
    if span is None or not size:
        return out
    base, last = span
    versions = last["version"] - base.get("version", 0)
    for name, key in (("served_per_version", "served_bytes"), ("fetched_per_version", "fetched_bytes")):
        before = base.get(key, 0 if base.get("kind") == "start" else None)
        if before is not None and last.get(key) is not None and versions > 0:
            out[name] = round((last[key] - before) / versions / size, 4)
    return out


def fetch_delays(peers: dict[str, list[dict]], start: float, end: float) -> dict:
    """Announcement -> the blob in hand (the follower's ``fetched_at``, before the swap waits for the batch to end),
    p50/p95 over the swap lines of versions announced in the window; None where the ledgers lack it."""
    delays = [
        max(0.0, x["fetched_at"] - x["announced"])
        for rows in peers.values()
        for x in rows
        if x.get("kind") == "swap" and x.get("fetched_at") and x.get("announced") and start <= x["announced"] <= end
    ]
    return {"pairs": len(delays), "p50_s": pct(delays, 0.5), "p95_s": pct(delays, 0.95)}


def served_sum(traffic: dict[str, dict]) -> float | None:
    """The rollout peers' served per version, summed (None if no peer reports it)."""
    served = [t["served_per_version"] for t in traffic.values() if t["served_per_version"] is not None]
    return round(sum(served), 4) if served else None


def summarize(versions: list[dict], peers: dict[str, list[dict]], start: float, end: float) -> dict:
    """Everything reported for one round, from its ledgers (pure: the unit tests feed it made-up ones)."""
    size = adapter_size(versions, peers)
    announced = len(window(versions, start, end))
    traffic = {name: peer_traffic(rows, start, end, size) for name, rows in peers.items()}
    p = propagation(peers, versions, start, end)
    return {
        "versions": announced,
        "versions_per_s": round(announced / (end - start), 4) if end > start else None,
        "adapter_size": size,
        "learner_upload_per_version": upload_per_version(versions, start, end, size),
        "rollout_served_per_version_sum": served_sum(traffic),
        "peers": traffic,
        "propagation": {k: p[k] for k in ("pairs", "p50_s", "p95_s", "every_peer_p50_s", "every_peer_p95_s")},
        "fetch": fetch_delays(peers, start, end),
    }


def run_round(root: Path, n: int, args) -> dict:
    pace = ["--bench-batch-seconds", str(args.batch_seconds)]
    r = Round(root, f"spread-{n}", [pace] * n, [], args.tau_max)
    try:
        start = r.start() + args.warmup
        end = start + args.seconds
        sleep_until(end, r)
    finally:
        codes = r.stop()
    return {"n": n, **summarize(r.versions(), r.peers(), start, end), "exit_codes": codes, "dir": str(r.dir)}


def cell(x, width: int, digits: int = 3) -> str:
    return f"{'-' if x is None else f'{x:.{digits}f}':>{width}}"


def report(results: list[dict]) -> None:
    print(
        f"\n{'N':>3} {'versions':>8} {'learner up/v':>12} {'peers up/v':>10} {'fetch p50':>9} {'p95':>6} "
        f"{'swap p50':>8} {'p95':>6}"
    )
    for r in results:
        p, f = r["propagation"], r["fetch"]
        print(
            f"{r['n']:>3} {r['versions']:>8} {cell(r['learner_upload_per_version'], 12)} "
            f"{cell(r['rollout_served_per_version_sum'], 10)} {cell(f['p50_s'], 9)} {cell(f['p95_s'], 6)} "
            f"{cell(p['p50_s'], 8)} {cell(p['p95_s'], 6)}"
        )
    ups = [r["learner_upload_per_version"] for r in results]
    if ups and all(u is not None for u in ups):
        print(f"learner upload per version: max {max(ups):.3f} adapter sizes (target <= 2 at every N)")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8], help="rollout peers per round")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per round")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after the first version, not measured")
    parser.add_argument("--batch-seconds", type=float, default=4.0, help="every rollout peer's seconds per batch")
    parser.add_argument("--tau-max", type=int, default=4, help="the run's staleness window (the host's default: 4)")
    parser.add_argument("--keep", default=None, help="keep the rounds' folders here (default: a temporary folder)")
    parser.add_argument("--out", default="spread.json")
    args = parser.parse_args(argv)
    if len(set(args.peers)) != len(args.peers):
        parser.error("--peers: each N once")
    results = []
    with tempfile.TemporaryDirectory(prefix="hivegrpo-bench-spread-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for n in args.peers:
            results.append(run_round(root, n, args))
            print(json.dumps(results[-1]), flush=True)
    report(results)
    result = {"config": vars(args), "rounds": results}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
