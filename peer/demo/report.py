"""What ``hivegrpo demo`` shows while it runs and leaves behind: the live table, metrics.json, the plots (when
matplotlib, the ``plots`` extra, is installed).

Everything here is drawn from numbers the demo measured: the observer's evaluations, the learner's ledger (one
line per version: time, reward, staleness, groups per peer) and the heartbeats' throughput.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from peer.plots import SKIPPED, pyplot


def read_ledger(path: Path, started: float) -> list[dict]:
    """The learner's versions from its ledger, with ``seconds`` since the demo started (a line cut by a stop is
    skipped, and so is an update that had no signal and made no version)."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("no_signal"):  # groups used up without making a version
            continue
        rows.append(
            {
                "seconds": round(entry["time"] - started, 2),
                "version": entry["version"],
                "groups": entry["groups"],
                "reward_mean": entry["reward_mean"],
                "staleness_mean": entry["staleness_mean"],
                "staleness_max": entry["staleness_max"],
                "per_peer": entry.get("per_peer", {}),
            }
        )
    return rows


def live_table(elapsed: float, duration: float, snapshot, evaluations: list[dict], stopped: list[str]):
    """The rich table the demo refreshes every second."""
    from rich.table import Table

    table = Table(title=f"hivegrpo demo — {elapsed:5.0f} s of {duration:.0f} s", show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    m = snapshot.learner if snapshot is not None else None
    if m:
        rejected = sum(m["groups_rejected"].values())
        table.add_row("adapter version", f"{m['version']} (observer holds {snapshot.adapter_version})")
        table.add_row(
            "groups accepted", f"{m['groups_accepted']} ({m['groups_dropped_stale']} stale, {rejected} refused)"
        )
        table.add_row("staleness", f"mean {m['staleness_mean']:.2f}, max {m['staleness_max']}")
        table.add_row("reward (last update)", f"{m['reward_mean']:.3f}")
    else:
        table.add_row("learner", "starting…")
    if evaluations:
        e = evaluations[-1]
        table.add_row("exact match", f"{e['exact_match']:.3f} (v{e['version']} at {e['seconds']:.0f} s)")
    for peer_id, rate in sorted((snapshot.rollout if snapshot is not None else {}).items()):
        table.add_row(f"rollout …{peer_id[-6:]}", f"{rate:.1f} groups/s")
    for name in stopped:
        table.add_row(name, "[red]exited[/red]")
    return table


def status_line(elapsed: float, snapshot, evaluations: list[dict]) -> str:
    """The same, as one line (when stderr is not a terminal)."""
    m = snapshot.learner if snapshot is not None else None
    parts = [f"{elapsed:.0f}s"]
    if m:
        parts += [f"v{m['version']}", f"{m['groups_accepted']} groups", f"reward {m['reward_mean']:.3f}"]
        parts += [f"staleness {m['staleness_mean']:.2f}"]
    if evaluations:
        parts.append(f"EM {evaluations[-1]['exact_match']:.3f} (v{evaluations[-1]['version']})")
    rates = snapshot.rollout.values() if snapshot is not None else []
    if rates:
        parts.append("rollout " + ", ".join(f"{r:.1f}" for r in rates) + " groups/s")
    return "  ".join(parts)


def used_rate(updates: list[dict], window: float) -> tuple[list[float], list[float]]:
    """Groups the learner used per second over the ``window`` seconds before each version (from the ledger)."""
    xs, ys = [], []
    for i, u in enumerate(updates):
        t = u["seconds"]
        if t - updates[0]["seconds"] < window:
            continue  # not a whole window yet
        xs.append(t)
        ys.append(sum(v["groups"] for v in updates[: i + 1] if v["seconds"] > t - window) / window)
    return xs, ys


def plot(report: dict, directory: Path) -> list[str]:
    """learning.png (exact match and reward against wall time) and throughput.png (groups/s per peer); the paths
    written. Without matplotlib (the ``plots`` extra) none: one line on stderr says so, and the rest of the report
    stands."""
    plt = pyplot()
    if plt is None:
        print(SKIPPED, file=sys.stderr, flush=True)
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    evaluations = report["evaluations"]
    ax.plot([e["seconds"] for e in evaluations], [e["exact_match"] for e in evaluations], "o-", label="exact match")
    rewards = report["updates"]
    if rewards:
        ax.plot([r["seconds"] for r in rewards], [r["reward_mean"] for r in rewards], "-", alpha=0.5, label="reward")
    if report["target"] is not None:
        ax.axhline(report["target"], linestyle="--", color="grey", linewidth=1, label=f"target {report['target']}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylim(0, 1)
    ax.set_title("held-out exact match (greedy) and update reward")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(directory / "learning.png", dpi=100)
    plt.close(fig)
    written.append(str(directory / "learning.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for peer_id, points in sorted(report["rollout_throughput"].items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], label=f"rollout …{peer_id[-6:]} (heartbeat)")
    xs, ys = used_rate(rewards, window=10.0)
    if xs:
        ax.plot(xs, ys, "-", color="black", linewidth=1.5, label="learner: groups used / s (10 s window)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("groups / s")
    ax.set_title("throughput")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(directory / "throughput.png", dpi=100)
    plt.close(fig)
    written.append(str(directory / "throughput.png"))
    return written


__all__ = ["live_table", "plot", "read_ledger", "status_line", "used_rate"]
