"""``hivegrpo demo``: a whole swarm on this machine, watched until it reaches its target or its time limit.

The clock starts before the first process does, so the reported seconds include every start-up. Every
``eval_every`` seconds the observer evaluates the newest adapter it holds (a version it has not evaluated yet);
the demo stops when an evaluation reaches ``target``, at ``duration``, or at ^C. The final adapter is the one of
the last evaluation (at the time limit or ^C, the newest version, evaluated again if it is newer; at the target,
the version that reached it), written to ``adapter/`` (a PEFT folder)
so ``hivegrpo eval --adapter`` can check ``final_exact_match`` independently.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from peer.demo.observer import Observer
from peer.demo.report import live_table, plot, read_ledger, status_line
from peer.demo.swarm import LocalSwarm
from peer.errors import UserError
from peer.log import get_logger

logger = get_logger(__name__)
SNAPSHOT_EVERY = 2.0  # s between two reads of the swarm's state for the live view (the metrics change every 2 s)


@dataclass(frozen=True)
class DemoConfig:
    duration: float = 300.0  # seconds, start-up included
    target: float | None = 0.8  # stop once held-out exact match reaches it; None: run for the whole duration
    rollout_peers: int = 2
    learners: int = 1
    report_dir: Path | None = None  # default: ./hivegrpo-demo-YYYYmmdd-HHMMSS
    eval_every: float = 15.0
    eval_n: int = 500
    run_id: str = "demo"

    def __post_init__(self):
        if not self.duration > 0:
            raise ValueError(f"duration must be positive, got {self.duration}")
        if self.target is not None and not 0.0 < self.target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        if self.rollout_peers < 1:
            raise ValueError(f"rollout_peers must be >= 1, got {self.rollout_peers}")
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if self.eval_n < 1 or not self.eval_every > 0:
            raise ValueError("eval_n must be >= 1 and eval_every positive")


def default_report_dir() -> Path:
    return Path.cwd() / time.strftime("hivegrpo-demo-%Y%m%d-%H%M%S")


def _evaluate(observer: Observer, n: int, t0: float) -> dict:
    point = {"version": observer.version, "exact_match": observer.exact_match(n)}
    point["seconds"] = round(time.monotonic() - t0, 2)
    logger.info("exact match %.3f at v%d (%.0f s)", point["exact_match"], point["version"], point["seconds"])
    return point


def run_demo(config: DemoConfig, live: bool | None = None) -> dict:
    """Run the demo; returns the report (also written to ``report_dir/metrics.json``)."""
    from rich.console import Console
    from rich.live import Live

    report_dir = Path(config.report_dir or default_report_dir()).resolve()
    report_dir.mkdir(parents=True, exist_ok=True)
    ledger = report_dir / "ledger.jsonl"
    ledger.unlink(missing_ok=True)
    console = Console(stderr=True)
    live = console.is_terminal if live is None else live
    started_wall, t0 = time.time(), time.monotonic()
    evaluations: list[dict] = []
    throughput: dict[str, list] = {}
    snapshot, stopped, reason = None, [], "time limit"
    with tempfile.TemporaryDirectory(prefix="hivegrpo-demo-") as tmp:
        swarm = LocalSwarm(
            Path(tmp),
            report_dir / "logs",
            run_id=config.run_id,
            rollout_peers=config.rollout_peers,
            ledger=ledger,
            learners=config.learners,
        )
        observer = None
        display = Live(console=console, refresh_per_second=2, transient=False) if live else None
        try:
            try:
                swarm.start()  # spawns the host first, then imports torch (the roles' modules) beside it
                info = swarm.info
                observer = Observer(config.run_id, info["initial_peers"], info["coordinator"], Path(tmp) / "observer")
                observer.start()
                if display is not None:
                    display.start()
                evaluations.append(_evaluate(observer, config.eval_n, t0))  # adapter v0, while the others start
                next_eval, next_line, next_snapshot = config.eval_every, 0.0, 0.0
                while True:
                    elapsed = time.monotonic() - t0
                    if elapsed >= config.duration:
                        break
                    stopped = swarm.check()
                    if elapsed >= next_snapshot:  # two DHT reads: the learner's metrics, the heartbeats
                        snapshot, next_snapshot = observer.snapshot(), elapsed + SNAPSHOT_EVERY
                        for peer_id, rate in snapshot.rollout.items():
                            throughput.setdefault(peer_id, []).append([round(elapsed, 2), round(rate, 3)])
                    # the newest adapter is fetched only when an evaluation is due (not every version)
                    if elapsed >= next_eval and observer.catch_up() and observer.version > evaluations[-1]["version"]:
                        next_eval = elapsed + config.eval_every
                        evaluations.append(_evaluate(observer, config.eval_n, t0))
                        if config.target is not None and evaluations[-1]["exact_match"] >= config.target:
                            reason = "target"
                            break
                    if display is not None:
                        display.update(live_table(elapsed, config.duration, snapshot, evaluations, stopped))
                    elif elapsed >= next_line:
                        print(status_line(elapsed, snapshot, evaluations), file=sys.stderr, flush=True)
                        next_line = elapsed + 10.0
                    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - elapsed)))
            except KeyboardInterrupt:
                reason = "interrupted"
                if not evaluations:
                    raise UserError("the demo was interrupted before its swarm was up; nothing to report") from None
            finally:
                if display is not None:
                    display.stop()
            seconds = round(time.monotonic() - t0, 2)
            if reason != "target":  # stopped by the clock or ^C: the newest version is the result
                observer.catch_up()
                if observer.version != evaluations[-1]["version"]:
                    evaluations.append(_evaluate(observer, config.eval_n, t0))
            # stopped at the target: the version that reached it is the result (a newer one may score less)
            from peer.model.peft_folder import base_model_name, write_peft_folder  # torch: not before the host starts

            base = base_model_name(observer.session.spec.manifest.model.name)
            write_peft_folder(report_dir / "adapter", observer.session.blob, base)
        finally:
            if observer is not None:
                observer.close()
            codes = swarm.stop()
        learner = swarm.learner.result() if swarm.learner else None
        helpers = [c.result() for c in swarm.learners[1:]]
        rollouts = {c.name: c.result() for c in swarm.rollouts}
    final = evaluations[-1]
    report = {
        "final_exact_match": final["exact_match"],
        "adapter_version": final["version"],
        "versions": learner["versions_made"] if learner else final["version"],
        "groups": learner["groups_accepted"] if learner else None,
        "seconds": seconds,
        "stopped_by": reason,
        "target": config.target,
        "report_dir": str(report_dir),
        "adapter": str(report_dir / "adapter"),
        "evaluations": evaluations,
        "updates": read_ledger(ledger, started_wall),
        "rollout_throughput": throughput,
        "learner": learner,
        "helpers": helpers,
        "rollout": rollouts,
        "exit_codes": codes,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
    }
    report["plots"] = plot(report, report_dir)
    (report_dir / "metrics.json").write_text(json.dumps(report, indent=2))
    return report


__all__ = ["DemoConfig", "run_demo"]
