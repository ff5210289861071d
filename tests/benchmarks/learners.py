"""One learner against a team of two: version cadence, exact match against wall time, and what a shared update costs.

Each round runs the demo's whole swarm (host, ``--rollout-peers`` rollout peers, and 1 or 2 learners; real
processes on loopback, one torch thread each, the demo's evaluation of the newest adapter every ``--eval-every``
seconds on ``--eval-n`` held-out examples) for ``--duration`` seconds without stopping at a target, alternating 1
and 2 learners. From the first learner's ledger (the whole lineage, whichever learner made a version):

* versions/s and groups/s after the first version, and the step time (the update, from taking its groups to the
  new adapter; for a team: the leader's share, the wait for the helper's, and the AdamW step);
* for a team, the cost of one shared round: the leader's own share (``share_seconds``) and its wait for the
  helper's gradient (``wait_seconds``), the fraction of updates a helper had a share in, and shares computed by
  the leader after a helper was late;
* exact match against wall time, and the first time an evaluation reached ``--target``::

    python -m tests.benchmarks.learners --rounds 1 --duration 240 --out learners.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tests.benchmarks import json_lines, mean

os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_round(root: Path, learners: int, args) -> dict:
    from peer.demo import DemoConfig, run_demo

    report_dir = root / f"learners-{learners}-{len(list(root.iterdir()))}"
    config = DemoConfig(
        duration=args.duration,
        target=None,
        rollout_peers=args.rollout_peers,
        learners=learners,
        report_dir=report_dir,
        eval_every=args.eval_every,
        eval_n=args.eval_n,
    )
    report = run_demo(config, live=False)
    made = [line for line in json_lines(report_dir / "ledger.jsonl") if not line.get("no_signal")]
    if len(made) < 2:
        raise RuntimeError(f"the swarm made {len(made)} versions in {args.duration} s: see {report_dir}/logs")
    span = made[-1]["time"] - made[0]["time"]
    shared = [line for line in made if line.get("helpers")]
    evaluations = report["evaluations"]
    reached = next((e["seconds"] for e in evaluations if e["exact_match"] >= args.target), None)
    helpers = report.get("helpers") or []
    return {
        "learners": learners,
        "versions": len(made),
        "versions_per_s": round((len(made) - 1) / span, 3),
        "groups_per_s": round(sum(line["groups"] for line in made[1:]) / span, 2),
        "step_seconds_mean": mean([line["step_seconds"] for line in made]),
        "shared_fraction": round(len(shared) / len(made), 3),
        "share_seconds_mean": mean([line["share_seconds"] for line in shared if "share_seconds" in line]),
        "wait_seconds_mean": mean([line["wait_seconds"] for line in shared if "wait_seconds" in line]),
        "shares_late": (report.get("learner") or {}).get("team", {}).get("shares_late", 0),
        "helper_shares": sum((h or {}).get("team", {}).get("shares", 0) for h in helpers),
        "staleness_mean": mean([line["staleness_mean"] for line in made]),
        "evaluations": [(e["seconds"], e["version"], e["exact_match"]) for e in evaluations],
        "final_exact_match": report["final_exact_match"],
        "seconds_to_target": reached,
        "exit_codes": report["exit_codes"],
        "report_dir": str(report_dir),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each of 1 and 2 learners")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds per run, start-up included")
    parser.add_argument("--rollout-peers", type=int, default=2)
    parser.add_argument("--eval-every", type=float, default=15.0)
    parser.add_argument("--eval-n", type=int, default=500)
    parser.add_argument("--target", type=float, default=0.8, help="exact match whose first time is reported")
    parser.add_argument("--keep", default=None, help="keep the runs' reports here (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="hivegrpo-bench-learners-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(args.rounds):
            for learners in (1, 2):
                rounds.append(run_round(root, learners, args))
                print(json.dumps({k: v for k, v in rounds[-1].items() if k != "evaluations"}), flush=True)
    result = {"rounds": rounds, "config": vars(args)}
    print(
        f"{'learners':>8} {'versions/s':>10} {'groups/s':>8} {'step s':>7} {'share s':>7} {'wait s':>7} "
        f"{'shared':>6} {'late':>4} {'EM end':>6} {'t(EM≥' + str(args.target) + ')':>10}"
    )
    for r in rounds:
        cells = [
            f"{r['learners']:>8}",
            f"{r['versions_per_s']:>10.3f}",
            f"{r['groups_per_s']:>8.2f}",
            f"{r['step_seconds_mean']:>7.3f}",
            f"{r['share_seconds_mean'] or 0:>7.3f}",
            f"{r['wait_seconds_mean'] or 0:>7.3f}",
            f"{r['shared_fraction']:>6.2f}",
            f"{r['shares_late']:>4}",
            f"{r['final_exact_match']:>6.3f}",
            f"{r['seconds_to_target'] if r['seconds_to_target'] is not None else '-':>10}",
        ]
        print(" ".join(cells))
    for r in rounds:
        curve = ", ".join(f"{s:.0f}s {em:.2f}" for s, _, em in r["evaluations"])
        print(f"EM, {r['learners']} learner(s): {curve}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
