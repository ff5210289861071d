"""What the coordinator costs a swarm: a private swarm's invite checks, and the coordinator's outage.

Each round starts ``hivegrpo host``, one ``hivegrpo join`` and one ``hivegrpo learn`` (real processes on loopback,
one torch thread each) and reads the learner's ledger (one JSON line per version, with its wall time):

* **private vs public** — rounds alternate public / ``--private`` (invites checked on every DHT request and blob
  request, see docs/coordinator.md); after a warm-up of ``--warmup`` versions, versions/s and groups/s over
  ``--seconds``. The ratio private / public is the cost of the checks (target: >= 0.9).
* **outage** — in the last round (public) the host's whole process group is SIGKILLed mid-run: the longest gap
  between two versions in the ``--seconds`` after the kill against the median gap before it (the learner's stall),
  and versions/s after the kill against before. Then the host restarts with the same identity: seconds until the
  peers' status lists it again::

    python -m tests.benchmarks.coordinator --rounds 2 --seconds 40 --out coordinator.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.benchmarks import json_lines
from tests.helpers.waiting import children as processes
from tests.helpers.waiting import wait_until

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _status(run_id: str, maddrs: list[str], invite: str | None) -> dict:
    from peer.demo.swarm import LOOPBACK

    argv = [sys.executable, "-m", "peer.cli", "status", "--run-id", run_id, "--json", *LOOPBACK]
    argv += [a for m in maddrs for a in ("--initial-peers", m)] + (["--invite", invite] if invite else [])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _rate(lines: list[dict], start: float, end: float) -> tuple[float, float]:
    window = [x for x in lines if start <= x["time"] < end]
    return len(window) / (end - start), sum(x["groups"] for x in window) / (end - start)


def run_round(root: Path, name: str, private: bool, args, outage: bool) -> dict:
    from peer.demo.swarm import LOOPBACK, Child

    run_id = f"bench-{name}"
    identity = root / f"{name}-host.id"
    info_file = root / f"{name}-info.json"
    host_argv = ["host", "--run-id", run_id, "--cache-dir", str(root / f"{name}-host"), "--identity", str(identity)]
    host_argv += ["--info-file", str(info_file), *LOOPBACK] + (["--private"] if private else [])
    children = [Child(f"{name}-host", host_argv, root)]
    try:
        wait_until(info_file.exists, "the host's join details", 120, processes(children), interval=0.5)
        info = json.loads(info_file.read_text())
        common = ["--run-id", run_id, "--coordinator", info["coordinator"], *LOOPBACK]
        common += [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
        common += ["--invite", info["invite"]] if info["invite"] else []
        ledger = root / f"{name}-ledger.jsonl"
        children.append(Child(f"{name}-rollout", ["join", *common, "--cache-dir", str(root / f"{name}-r")], root))
        learn = [
            "learn",
            *common,
            "--learner-credential",
            info["learner_credential"],
            "--cache-dir",
            str(root / f"{name}-l"),
            "--ledger",
            str(ledger),
        ]
        children.append(Child(f"{name}-learner", learn, root))
        wait_until(
            lambda: len(json_lines(ledger)) >= args.warmup,
            f"{args.warmup} versions",
            300,
            processes(children),
            interval=0.5,
        )
        start = time.time()
        time.sleep(args.seconds)
        versions_per_s, groups_per_s = _rate(json_lines(ledger), start, time.time())
        result = {"private": private, "versions_per_s": round(versions_per_s, 3)}
        result["groups_per_s"] = round(groups_per_s, 2)
        if outage:
            result |= measure_outage(root, name, children, ledger, host_argv, info, args)
        return result
    finally:
        for c in reversed(children):
            c.stop()


def measure_outage(root, name, children, ledger, host_argv, info, args) -> dict:
    from peer.demo.swarm import Child

    host = children[0]
    peers = _status(info["run_id"], info["initial_peers"], info["invite"])
    others = [m for p in peers.get("peers", []) if p["role"] != "coordinator" for m in p["maddrs"]]
    before = json_lines(ledger)
    killed = time.time()
    os.killpg(host.process.pid, signal.SIGKILL)
    host.process.wait()
    time.sleep(args.seconds)
    lines = json_lines(ledger)
    gaps_before = [b["time"] - a["time"] for a, b in zip(before[-60:], before[-59:], strict=False)]
    after = [x["time"] for x in lines if x["time"] >= killed]
    stall = max([after[0] - killed] + [b - a for a, b in zip(after, after[1:], strict=False)]) if after else None
    v_before, _ = _rate(lines, killed - args.seconds, killed)
    v_after, _ = _rate(lines, killed, killed + args.seconds)
    restarted = time.time()
    children[0] = Child(f"{name}-host2", host_argv, root)  # same identity: it rejoins through the peers it saw

    def listed():
        s = _status(info["run_id"], others, info["invite"])
        hosts = [p for p in s.get("peers", []) if p["role"] == "coordinator" and p["state"] == "running"]
        return [p for p in hosts if p["uptime_s"] < time.time() - restarted + 5]

    wait_until(listed, "the restarted host in the peers' status", 180, processes(children), interval=0.5)
    return {
        "gap_median_before_s": round(statistics.median(gaps_before), 3),
        "stall_after_kill_s": None if stall is None else round(stall, 3),
        "versions_per_s_before_kill": round(v_before, 3),
        "versions_per_s_after_kill": round(v_after, 3),
        "rejoin_seconds": round(time.time() - restarted, 1),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each of public and private")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per round (and after the kill)")
    parser.add_argument("--warmup", type=int, default=10, help="versions before the measurement starts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(args.rounds):
            for private in (False, True):
                last = i == args.rounds - 1 and private
                mode = "private" if private else "public"
                rounds.append(run_round(root, f"{mode}{i}", private, args, outage=False))
                print(json.dumps(rounds[-1]), flush=True)
                if last:
                    rounds.append(run_round(root, f"outage{i}", False, args, outage=True))
                    print(json.dumps(rounds[-1]), flush=True)
    public = [r["versions_per_s"] for r in rounds if not r["private"] and "stall_after_kill_s" not in r]
    private = [r["versions_per_s"] for r in rounds if r["private"]]
    result = {
        "rounds": rounds,
        "private_over_public": round(statistics.median(private) / statistics.median(public), 3),
        "outage": rounds[-1],
    }
    print(f"{'round':6} {'mode':8} {'versions/s':>11} {'groups/s':>9}")
    for i, r in enumerate(rounds):
        mode = "private" if r["private"] else ("outage" if "stall_after_kill_s" in r else "public")
        print(f"{i:<6} {mode:8} {r['versions_per_s']:11.3f} {r['groups_per_s']:9.2f}")
    o = rounds[-1]
    print(
        f"private / public versions/s (medians): {result['private_over_public']:.3f}\n"
        f"outage: median gap {o['gap_median_before_s']} s before the kill, longest {o['stall_after_kill_s']} s after; "
        f"versions/s {o['versions_per_s_before_kill']} before, {o['versions_per_s_after_kill']} after; "
        f"restarted host listed after {o['rejoin_seconds']} s"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
