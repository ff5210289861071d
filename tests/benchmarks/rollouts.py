"""Rollout peers in a swarm: a straggler, churn, and how fast a new adapter reaches every peer.

Each round runs the demo's local swarm (:class:`peer.demo.swarm.LocalSwarm`: host, 3 rollout peers, 1 learner; real
processes on loopback, one torch thread each; the host with ``--groups-per-version 24``, so an update is one batch of 8
prompts from each of 3 peers). Every rollout peer writes its ledger (``hivegrpo join --ledger``: a line when ready, per
batch and per adapter swap), the learner its own (a line per version with the groups each peer gave). Rollout peers are
*paced* with the harness's ``--bench-batch-seconds S`` (:mod:`tests.benchmarks.harness`; a batch lasts at least S
seconds: after sampling, a sleep until then before its groups are published, as on a machine that needs S seconds per
batch; the sleep leaves the CPU to the others, so each peer's rate is set by S, not by who wins the 2 cores): unpaced,
three peers on 2 cores outrun the learner, and a swarm bound by its learner loses nothing to a slow peer. Rounds, each
``--warmup`` s after the first version then ``--seconds`` measured:

* **plain**: 3 unpaced peers (the demo's settings): the learner-bound case, and propagation with short batches.
* **straggler, async**: peers paced at ``--batch-seconds`` (8 groups a batch), rollout-3 ``--slowdown`` times slower.
* **straggler, barrier**: the same peers under a synchronous barrier: the learner's ``--bench-barrier`` takes an
  update only when every contributing peer has its share (8) sampled with the current version, exactly that share
  each; the rollout peers' ``--bench-one-batch-per-version`` makes one batch per version, then waits for the next.
  Targets: async accepted groups/s >= 2.5 x barrier, and the groups the learner took in (used, or verified and
  counted as without signal: ``taken_rate``) >= 0.9 x the sum of the peers' own rates (a peer's own rate: its groups
  over its batches' time, pacing included and waits excluded: what it makes when never held). Groups without
  signal never take an update's slot, so used groups alone are bounded by the task's share with signal.
* **churn**: 3 peers paced at ``--batch-seconds``; a third into the measured window rollout-2's whole process group
  is killed (SIGKILL) and a new peer (rollout-4) starts at once. Reported: the longest gap between versions after the
  kill against the longest before it (target: stall = the difference <= 2 s; versions come in bursts, so the longest
  gap, not the median, is the baseline), accepted groups/s before, after the kill until the newcomer's first group is
  used, and after that; the killed peer's share of the updates before the kill (target: the fall is at most that
  share + 10 points); the newcomer's start-up (spawn -> ready) and ready -> its first group in an update.

**Propagation** (every round): for each version announced in the window and each rollout peer alive then, the time
from the announcement (its ``created`` time, in the swap lines of the peers that took it) to the peer's swap to that
version or a newer one (the next batch samples with it): p50/p95 over (version, peer) pairs, and per version for the
last peer to get it ("every peer"); and the adapter bytes each peer received over the network, in adapter sizes,
per version fetched, per version announced while it ran (what a version costs the peers that serve it) and per
version it sampled with (a peer fetches each newer version as it is announced, so one announced while a batch runs
and superseded before the batch ends is fetched and never used). Targets: p50 <= 1 s on loopback; bytes <= 1.1 x::

    python -m tests.benchmarks.rollouts --seconds 90 --out rollouts.json

Not a test: numbers depend on the machine; docs/benchmarks.md records runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from peer.plots import require
from tests.benchmarks import json_lines, mean

os.environ.setdefault("OMP_NUM_THREADS", "1")

GROUPS_PER_VERSION = 24


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (nearest rank) of ``values``, or None."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 4)


def accepted_rate(versions: list[dict], start: float, end: float) -> float | None:
    """Groups per second the learner took into updates between ``start`` and ``end`` (version times)."""
    return _rate(versions, start, end, no_signal=False)


def taken_rate(versions: list[dict], start: float, end: float) -> float | None:
    """Groups per second the learner took in between ``start`` and ``end``: into updates, or verified and counted as
    without signal (``dropped_no_signal``, a running count on each version's line). A group whose rewards are all
    equal teaches nothing and never takes an update's slot (docs/learner.md), so what a peer makes is used or not by
    this measure; what is left out is lost to staleness or refused."""
    return _rate(versions, start, end, no_signal=True)


def _rate(versions: list[dict], start: float, end: float, no_signal: bool) -> float | None:
    """The versions inside the window, the first one opening the span: their groups (and, with ``no_signal``, the
    groups counted without signal meanwhile) per second, or None for fewer than two versions."""
    inside = [v for v in versions if start <= v["time"] <= end]
    if len(inside) < 2:
        return None
    groups = sum(v["groups"] for v in inside[1:])
    if no_signal:
        groups += inside[-1].get("dropped_no_signal", 0) - inside[0].get("dropped_no_signal", 0)
    return round(groups / (inside[-1]["time"] - inside[0]["time"]), 3)


def own_rate(batches: list[dict], start: float, end: float) -> float | None:
    """A peer's groups per second of its own batches' time (pacing in, waits out) between ``start`` and ``end``."""
    inside = [b for b in batches if start <= b["time"] <= end]
    seconds = sum(b["sample_seconds"] for b in inside)
    return round(sum(b["groups"] for b in inside) / seconds, 3) if seconds else None


def gaps(versions: list[dict], start: float, end: float) -> list[float]:
    times = [v["time"] for v in versions if start <= v["time"] <= end]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def propagation(peers: dict[str, list[dict]], versions: list[dict], start: float, end: float) -> dict:
    """Announcement -> swap delays per (version, peer) and per version (the last peer), and bytes per fetch.

    ``peers``: each rollout peer's ledger lines; ``versions``: the learner's (fallback announcement times: a
    version no peer swapped to directly has no ``created`` time in any swap line).
    """
    swaps = {name: [x for x in rows if x.get("kind") == "swap"] for name, rows in peers.items()}
    announced: dict[int, float] = {}
    for rows in swaps.values():
        for x in rows:
            if x.get("announced"):
                announced[x["version"]] = min(announced.get(x["version"], x["announced"]), x["announced"])
    for v in versions:
        announced.setdefault(v["version"], v["time"])
    pairs, every = [], []
    for version, t in sorted(announced.items()):
        if not start <= t <= end:
            continue
        delays, complete = [], True
        for name, rows in peers.items():
            started = next((x["time"] for x in rows if x.get("kind") == "start"), None)
            if started is None or started > t or not any(x["time"] > t for x in rows):
                continue  # not there yet (it starts with the newest version), or gone
            took = next((x for x in swaps[name] if x["version"] >= version), None)
            if took is None:
                complete = False  # the run ended first
                continue
            delays.append(max(0.0, took["time"] - t))
        pairs += delays
        if delays and complete:
            every.append(max(delays))
    return {
        "pairs": len(pairs),
        "p50_s": pct(pairs, 0.5),
        "p95_s": pct(pairs, 0.95),
        "every_peer_p50_s": pct(every, 0.5),
        "every_peer_p95_s": pct(every, 0.95),
        "bytes": {name: adapter_bytes(rows, announced) for name, rows in peers.items()},
    }


def adapter_bytes(rows: list[dict], announced: dict[int, float]) -> dict | None:
    """A peer's adapter bytes received over its run, in adapter sizes: per version fetched, per version announced
    while it ran (what each version costs its providers), and per version it sampled with (swaps)."""
    started = next((x for x in rows if x.get("kind") == "start"), None)
    swaps = [x for x in rows if x.get("kind") == "swap"]
    if started is None or not swaps or not swaps[-1]["fetches"]:
        return None
    last = swaps[-1]
    size, received = last["size"], last["fetched_bytes"]
    newer = [v for v, t in announced.items() if v > started["version"] and t <= rows[-1]["time"]]
    return {
        "per_fetch": round(received / last["fetches"] / size, 4),
        "per_version_announced": round(received / len(newer) / size, 4) if newer else None,
        "per_version_used": round(received / len(swaps) / size, 4),
    }


def share_of(versions: list[dict], signer: str) -> float | None:
    total = sum(v["groups"] for v in versions)
    return round(sum(v.get("per_peer", {}).get(signer, 0) for v in versions) / total, 4) if total else None


class Round:
    """One swarm: start, wait for the first version, run, stop; the ledgers of all its peers."""

    def __init__(
        self, root: Path, name: str, rollout_args: list[list[str]], learner_args: list[str] = (), tau_max: int = 4
    ):
        from peer.demo.swarm import LocalSwarm

        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.name = name
        args = [[*a, "--ledger", str(self.dir / f"rollout-{i + 1}.jsonl")] for i, a in enumerate(rollout_args)]
        self.swarm = LocalSwarm(
            self.dir,
            self.dir / "logs",
            run_id=f"bench-{name}",
            rollout_peers=len(rollout_args),
            ledger=self.dir / "learner.jsonl",
            host_args=["--groups-per-version", str(GROUPS_PER_VERSION), "--tau-max", str(tau_max)],
            learner_args=list(learner_args),
            rollout_args=args,
            module="tests.benchmarks.harness",  # the --bench-* strategies
        )
        self.spawned: dict[str, float] = {}

    def versions(self) -> list[dict]:
        return [v for v in json_lines(self.dir / "learner.jsonl") if not v.get("no_signal")]

    def peers(self) -> dict[str, list[dict]]:
        return {c.name: json_lines(self.dir / f"{c.name}.jsonl") for c in self.swarm.rollouts}

    def start(self, timeout: float = 240.0) -> float:
        """Start the swarm; the wall time of its first version."""
        self.swarm.start()
        self.spawned = {c.name: time.time() for c in self.swarm.rollouts}
        deadline = time.monotonic() + timeout
        while not self.versions():
            self.swarm.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no version within {timeout:.0f} s: see {self.dir}/logs")
            time.sleep(0.5)
        return self.versions()[0]["time"]

    def add(self, name: str, extra: list[str]) -> None:
        self.swarm.add_rollout(name, [*extra, "--ledger", str(self.dir / f"{name}.jsonl")])
        self.spawned[name] = time.time()

    def kill(self, name: str) -> float:
        child = next(c for c in self.swarm.rollouts if c.name == name)
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()
        return time.time()

    def stop(self) -> dict:
        return self.swarm.stop()


def sleep_until(t: float, swarm_round: Round) -> None:
    while time.time() < t:
        swarm_round.swarm.check()
        time.sleep(min(1.0, max(0.0, t - time.time())))


def run_simple(root: Path, name: str, rollout_args, learner_args, args) -> dict:
    r = Round(root, name, rollout_args, learner_args, args.tau_max)
    try:
        first = r.start()
        start = first + args.warmup
        end = start + args.seconds
        sleep_until(end, r)
    finally:
        codes = r.stop()
    versions, peers = r.versions(), r.peers()
    rates = {n: own_rate([x for x in rows if x.get("kind") == "batch"], start, end) for n, rows in peers.items()}
    return {
        "round": name,
        "accepted_groups_per_s": accepted_rate(versions, start, end),
        "taken_groups_per_s": taken_rate(versions, start, end),
        "own_rates": rates,
        "own_rates_sum": round(sum(x for x in rates.values() if x), 3),
        "versions": len([v for v in versions if start <= v["time"] <= end]),
        "staleness_mean": mean([v["staleness_mean"] for v in versions if start <= v["time"] <= end]),
        "step_seconds_mean": mean([v["step_seconds"] for v in versions if start <= v["time"] <= end]),
        "propagation": propagation(peers, versions, start, end),
        "series": series(versions, start),
        "exit_codes": codes,
        "dir": str(r.dir),
    }


def series(versions: list[dict], start: float) -> list[list[float]]:
    """``[seconds from the window's start, groups]`` of every version (for plots)."""
    return [[round(v["time"] - start, 3), v["groups"]] for v in versions]


def run_churn(root: Path, pace: list[str], args) -> dict:
    r = Round(root, "churn", [pace, pace, pace], tau_max=args.tau_max)
    try:
        first = r.start()
        start = first + args.warmup
        end = start + args.seconds
        sleep_until(start + args.seconds / 3, r)
        killed = r.kill("rollout-2")
        r.add("rollout-4", pace)
        sleep_until(end, r)
    finally:
        codes = r.stop()
    versions, peers = r.versions(), r.peers()
    signer = {n: next((x["signer"] for x in rows if x.get("kind") == "start"), None) for n, rows in peers.items()}
    newcomer = peers.get("rollout-4", [])
    ready = next((x["time"] for x in newcomer if x.get("kind") == "start"), None)
    used = next((v["time"] for v in versions if v.get("per_peer", {}).get(signer.get("rollout-4"), 0)), None)
    before = [v for v in versions if start <= v["time"] <= killed]
    share = share_of(before, signer["rollout-2"]) if signer.get("rollout-2") else None
    rate_before = accepted_rate(versions, start, killed)
    rate_gap = accepted_rate(versions, killed, used or end)
    rate_after = accepted_rate(versions, used, end) if used else None
    before_gaps = gaps(versions, start, killed) or [0.0]
    prev = max((v["time"] for v in versions if v["time"] <= killed), default=killed)
    after_gaps = [
        *gaps(versions, killed, used or end),
        min((v["time"] for v in versions if v["time"] > killed), default=end) - prev,
    ]
    stall = max(after_gaps) - max(before_gaps)
    return {
        "round": "churn",
        "killed_at_s": round(killed - start, 2),
        "killed_share": share,
        "accepted_before": rate_before,
        "accepted_without": rate_gap,
        "accepted_after_newcomer": rate_after,
        "fall": round(1 - rate_gap / rate_before, 4) if rate_before and rate_gap else None,
        "mean_gap_before_s": round(statistics.fmean(before_gaps), 3),
        "longest_gap_before_s": round(max(before_gaps), 3),
        "mean_gap_after_s": round(statistics.fmean(after_gaps), 3),
        "longest_gap_after_s": round(max(after_gaps), 3),
        "stall_s": round(stall, 3),
        "newcomer_startup_s": round(ready - r.spawned["rollout-4"], 2) if ready else None,
        "newcomer_ready_to_used_s": round(used - ready, 2) if used and ready else None,
        "propagation": propagation(peers, versions, start, end),
        "series": series(versions, start),
        "newcomer_started_s": round(r.spawned["rollout-4"] - start, 2),
        "exit_codes": codes,
        "dir": str(r.dir),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="measured seconds per round")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds after the first version, not measured")
    parser.add_argument("--batch-seconds", type=float, default=1.0, help="a paced peer's seconds per batch")
    parser.add_argument("--slowdown", type=float, default=4.0, help="how much slower the straggler is than the rest")
    parser.add_argument(
        "--rounds",
        nargs="+",
        default=["plain", "async", "barrier", "churn"],
        choices=["plain", "async", "barrier", "churn"],
    )
    parser.add_argument("--tau-max", type=int, default=4, help="the run's staleness window (the host's default: 4)")
    parser.add_argument("--keep", default=None, help="keep the rounds' folders here (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="write groups used against time for each round here (PNG)")
    args = parser.parse_args(argv)
    if args.plot:
        require("--plot")  # now, not after the whole run
    pace = ["--bench-batch-seconds", str(args.batch_seconds)]
    slow = ["--bench-batch-seconds", str(args.batch_seconds * args.slowdown)]
    barrier = ["--bench-one-batch-per-version"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="hivegrpo-bench-rollouts-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in args.rounds:
            if name == "plain":
                results[name] = run_simple(root, name, [[], [], []], [], args)
            elif name == "async":
                results[name] = run_simple(root, name, [pace, pace, slow], [], args)
            elif name == "barrier":
                peers = [[*pace, *barrier], [*pace, *barrier], [*slow, *barrier]]
                results[name] = run_simple(root, name, peers, ["--bench-barrier"], args)
            else:
                results[name] = run_churn(root, pace, args)
            print(json.dumps(results[name]), flush=True)
    report(results, args)
    result = {"rounds": results, "config": vars(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(results, args.seconds, Path(args.plot))
    return result


def plot(results: dict, seconds: float, path: Path) -> None:
    """Groups the learner used against time (from the measured window's start), one line per round."""
    plt = require("--plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        points = [p for p in r["series"] if 0 <= p[0] <= seconds]
        total, xs, ys = 0, [], []
        for t, groups in points:
            total += groups
            xs.append(t)
            ys.append(total)
        ax.step(xs, ys, where="post", label=name)
    churn = results.get("churn")
    if churn:
        ax.axvline(churn["killed_at_s"], color="red", linestyle=":", linewidth=1, label="churn: a peer killed")
        if churn.get("newcomer_ready_to_used_s") is not None and churn.get("newcomer_startup_s") is not None:
            used = churn["newcomer_started_s"] + churn["newcomer_startup_s"] + churn["newcomer_ready_to_used_s"]
            ax.axvline(used, color="green", linestyle=":", linewidth=1, label="churn: newcomer's first group used")
    ax.set_xlabel("seconds of the measured window")
    ax.set_ylabel("groups used by the learner")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(results: dict, args) -> None:
    print(
        f"\n{'round':>8} {'accepted/s':>10} {'own sum/s':>9} {'versions':>8} {'tau':>5} {'prop p50':>8} "
        f"{'p95':>6} {'every p50':>9} {'p95':>6} {'bytes/ann.':>10} {'bytes/use':>9}"
    )
    for name, r in results.items():
        p = r["propagation"]
        size = max((b["per_version_announced"] or 0 for b in p["bytes"].values() if b), default=None)
        cells = [
            f"{name:>8}",
            f"{r.get('accepted_groups_per_s') or r.get('accepted_before') or 0:>10.2f}",
            f"{r.get('own_rates_sum', 0):>9.2f}",
            f"{r.get('versions', 0):>8}",
            f"{r.get('staleness_mean') or 0:>5.2f}",
            f"{p['p50_s'] or 0:>8.3f}",
            f"{p['p95_s'] or 0:>6.3f}",
            f"{p['every_peer_p50_s'] or 0:>9.3f}",
            f"{p['every_peer_p95_s'] or 0:>6.3f}",
            f"{size or 0:>10.3f}",
            f"{max((b['per_version_used'] for b in p['bytes'].values() if b), default=0):>9.3f}",
        ]
        print(" ".join(cells))
    a, b = results.get("async"), results.get("barrier")
    if a and b and a["accepted_groups_per_s"] and b["accepted_groups_per_s"]:
        print(
            f"straggler: async {a['accepted_groups_per_s']:.2f} groups/s = "
            f"{a['accepted_groups_per_s'] / b['accepted_groups_per_s']:.2f} x barrier (target >= 2.5), "
            f"{a['accepted_groups_per_s'] / a['own_rates_sum']:.2f} x the peers' own rates; taken in (used or without "
            f"signal) {(a.get('taken_groups_per_s') or 0) / a['own_rates_sum']:.2f} x (target >= 0.9)"
        )
    c = results.get("churn")
    if c:
        print(
            f"churn: stall {c['stall_s']} s (longest gap between versions {c['longest_gap_after_s']} s after the kill "
            f"vs {c['longest_gap_before_s']} s before; target <= 2 s); accepted {c['accepted_before']} -> "
            f"{c['accepted_without']}"
            f" -> {c['accepted_after_newcomer']} groups/s; fall {c['fall']} vs the killed peer's share "
            f"{c['killed_share']} (+0.10 allowed); newcomer start-up {c['newcomer_startup_s']} s, ready -> used "
            f"{c['newcomer_ready_to_used_s']} s"
        )


if __name__ == "__main__":
    main()
