"""Faults in real processes: peers killed (SIGKILL) and frozen (SIGSTOP, then SIGCONT) while a swarm runs.

Every peer runs in a process group of its own (its DHT process and libp2p daemon with it), so a signal to the group
is what a machine that dies or hangs does to the swarm. The test process is one more peer: a :class:`Watch` thread
reads the adapter announcements and the heartbeats every 0.25 s for the whole run, and the learners' ledgers say
which groups each version used. What must hold, whatever is killed or frozen:

* the run goes on (versions keep coming) while a rollout peer, the coordinator or a learner is dead or frozen;
* no version number is ever announced with two different adapters, every announced version is in the lineage the
  surviving learners hold at the end (nothing announced is lost), and no peer's version goes backwards;
* every group is used by at most one version of that lineage;
* a frozen peer that thaws rejoins without corrupting anything (its late groups are dropped as stale, not held
  against it; a thawed leader finds the team led by another and helps it);
* a learner killed between checkpoints resumes, after a restart, from its checkpoint and journal.
"""

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from peer.network.heartbeat import HEARTBEAT_INTERVAL
from tests.helpers.swarm import exit_summary, fingerprint, join_args, learn_args, read_ledger, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


class Watch:
    """Polls the run's announcements and heartbeats on a thread; keeps everything it saw, with the time."""

    def __init__(self, swarm):
        self.swarm = swarm
        self.announced: dict[int, set[str]] = {}  # version -> every sha256 ever announced for it
        self.versions: dict[str, list[int]] = {}  # peer id -> the adapter versions its heartbeats said, in order
        self.last_seen: dict[str, float] = {}  # peer id -> its newest heartbeat's last_seen
        self.leading: dict[str, bool] = {}  # learner peer id -> whether its newest heartbeat says it leads
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Watch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def leader(self) -> str | None:
        leaders = [p for p, leads in self.leading.items() if leads]
        return leaders[0] if len(leaders) == 1 else None

    def _run(self) -> None:
        from peer.network.heartbeat import live_peers
        from peer.run.adapters import announcements

        while not self._stop.wait(0.25):
            try:
                for _, record in announcements(self.swarm):
                    self.announced.setdefault(record.version, set()).add(record.sha256)
                for peer in live_peers(self.swarm):
                    r = peer.record
                    seen = self.versions.setdefault(r.peer_id, [])
                    if not seen or seen[-1] != r.adapter_version:
                        seen.append(r.adapter_version)
                    self.last_seen[r.peer_id] = r.last_seen
                    if r.role == "learner":
                        self.leading[r.peer_id] = r.stats.get("leading") == 1.0
            except Exception:  # the network boundary of an observer: count it, look again
                self.errors += 1


def _lineage(ledgers: list[list[dict]], head: str) -> list[dict]:
    """The chain of versions from v1 to ``head`` (a sha256), from whichever ledger lines name them."""
    by_sha = {line["sha256"]: line for lines in ledgers for line in lines if not line.get("no_signal")}
    chain = []
    while head in by_sha:
        chain.append(by_sha[head])
        head = by_sha[head]["parent_sha256"]
    return chain[::-1]


class Run:
    """The peers of one fault test, each in a process group of its own, and what they wrote."""

    def __init__(self, procs, tmp_path: Path, reader, run_id: str):
        self.procs, self.root = procs, tmp_path
        self.host, self.info = start_host(
            procs, tmp_path, run_id, "--groups-per-version", "4", "--learners", "2", new_session=True
        )
        self.net = join_args(self.info)
        self.peers: dict = {}
        self.ledgers: dict[str, Path] = {}
        swarm, _ = reader(run_id, self.info["initial_peers"])
        self.watch = Watch(swarm).start()

    def learner(self, name: str, label: str | None = None, checkpoint: bool = True):
        """``hivegrpo learn`` with identity, cache (and checkpoint directory) named ``name``; ``label``: its log and
        ledger (a restart of ``name`` under another label keeps the first run's files). Learners "a" and "b" have a
        learn line each: a credential admits one key."""
        label = label or name
        self.ledgers[label] = self.root / f"{label}.jsonl"
        args = [
            "learn",
            *learn_args(self.info, "ab".index(name)),
            "--cache-dir",
            str(self.root / name),
            "--identity",
            str(self.root / f"{name}.id"),
        ]
        if checkpoint:
            args += ["--checkpoint-dir", str(self.root / f"{name}.ckpt")]
        args += ["--ledger", str(self.ledgers[label]), "--json"]
        self.peers[label] = self.procs.start(label, *args, new_session=True)
        return self.peers[label]

    def rollout(self, name: str):
        args = ["join", *self.net, "--cache-dir", str(self.root / name), "--identity", str(self.root / f"{name}.id")]
        self.peers[name] = self.procs.start(name, *args, "--batch-size", "4", "--json", new_session=True)
        return self.peers[name]

    def alive(self) -> list:
        return [p for p in self.peers.values() if p.poll() is None and p.pid not in self.procs.frozen]

    def made(self, *labels: str) -> int:
        """The newest version in these learners' ledgers (all by default): their own files, read now."""
        labels = labels or tuple(self.ledgers)
        return max((line["version"] for n in labels for line in read_ledger(self.ledgers[n])), default=0)

    def advance(self, n: int, what: str, timeout: float = 120.0, by: tuple[str, ...] = ()) -> int:
        start = self.made()
        wait_until(lambda: self.made(*by) >= start + n, f"{n} more versions {what}", timeout, self.alive())
        return self.made(*by)

    def peer_id(self, name: str) -> str:
        from hivemind.p2p import PeerID

        identity = self.root / f"{name}.id"
        wait_until(identity.exists, f"{name}'s identity file", 60)
        return PeerID.from_identity(identity.read_bytes()).to_base58()

    def stop(self, *labels: str) -> dict[str, dict]:
        """SIGTERM these peers, then the host; their ``--json`` summaries (each must exit 0)."""
        for label in labels:
            self.peers[label].send_signal(signal.SIGTERM)
        summaries = {label: exit_summary(self.peers[label]) for label in labels}
        self.host.send_signal(signal.SIGTERM)
        self.host.communicate(timeout=90)
        self.watch.stop()
        assert all(self.peers[n].returncode == 0 for n in labels), {n: p.returncode for n, p in self.peers.items()}
        assert self.host.returncode == 0, self.procs.log(self.host)[-2000:]
        return summaries

    def check_one_lineage(self, head: dict) -> dict:
        """Nothing announced twice with different bytes, nothing announced lost, every group used once, no
        version going backwards, nobody banned — up to ``head`` (a learner's final summary). Returns the counts."""
        watch = self.watch
        forks = {v: shas for v, shas in watch.announced.items() if len(shas) > 1}
        assert not forks, f"versions announced with two adapters: {forks}"
        chain = _lineage([read_ledger(path) for path in self.ledgers.values()], head["adapter_sha256"])
        assert [line["version"] for line in chain] == list(range(1, head["adapter_version"] + 1))
        on_chain = {(line["version"], line["sha256"]) for line in chain}
        lost = {(v, sha) for v, shas in watch.announced.items() for sha in shas if v > 0 and (v, sha) not in on_chain}
        assert not lost, f"announced versions that are not in the final lineage: {sorted(lost)}"
        ids = [tuple(i) for line in chain for i in line["ids"]]
        assert len(ids) == len(set(ids)), "a group used by two versions of the lineage"
        for peer_id, versions in watch.versions.items():
            held = [v for v in versions if v >= 0]  # -1: starting, nothing held yet (a restarted peer)
            assert held == sorted(held), f"{peer_id} went from one version back to an older one: {versions}"
        banned = {b for line in chain for b in line["banned"]}
        assert not banned, f"honest peers banned: {banned}"  # a thawed peer's late groups are stale, not lies
        assert watch.errors < 10
        return {
            "versions": head["adapter_version"],
            "announced_versions_seen": len(watch.announced),
            "forks": len(forks),
            "announced_lost": len(lost),
            "groups_used": len(ids),
            "groups_used_twice": len(ids) - len(set(ids)),
        }


@pytest.mark.slow  # 65-180 s: with test_liars, a fifth of the default run; `make test-all` runs it
@pytest.mark.timeout(600)
def test_a_swarm_goes_on_through_dead_and_frozen_peers_and_loses_no_version(tmp_path, procs, reader):
    run = Run(procs, tmp_path, reader, "faults")
    fp = {name: fingerprint(tmp_path / f"{name}.id") for name in ("r1", "r2", "r3")}
    for name in ("r1", "r2", "r3"):
        run.rollout(name)
    run.learner("a")
    watch, peers = run.watch, run.peers
    timeline: dict = {}
    run.advance(2, "from the first learner")
    run.learner("b")
    wait_until(lambda: len(watch.leading) == 2 and watch.leader() is not None, "two learners, one leading", 90)
    run.advance(3, "from the team")

    # a rollout peer dies
    procs.kill_group(peers.pop("r1"))
    run.advance(3, "after a rollout peer died")

    # a rollout peer hangs (long enough to miss a heartbeat), then comes back: its groups are used again
    r2 = run.peer_id("r2")
    procs.freeze(peers["r2"])
    run.advance(2, "while a rollout peer is frozen")
    wait_until(
        lambda: time.time() - watch.last_seen.get(r2, 0.0) > HEARTBEAT_INTERVAL + 2,
        "the frozen rollout peer to miss a heartbeat",
        60,
        run.alive(),
    )
    procs.thaw(peers["r2"])
    thawed_at = run.made()

    def r2_used_after_thaw() -> bool:
        lines = [line for name in ("a", "b") for line in read_ledger(run.ledgers[name])]
        return any(i[0] == fp["r2"] for line in lines if line["version"] > thawed_at for i in line.get("ids", []))

    wait_until(r2_used_after_thaw, "the thawed rollout peer's groups in an update", 120, run.alive())

    # the coordinator hangs: nobody needs it
    procs.freeze(run.host)
    t0 = time.monotonic()
    run.advance(3, "while the coordinator is frozen")
    timeline["3_versions_with_coordinator_frozen_s"] = time.monotonic() - t0
    procs.thaw(run.host)

    # the leading learner hangs: the other takes over; thawed, the first helps the second
    leader = watch.leader()
    assert leader is not None, watch.leading
    frozen = {run.peer_id(name): name for name in ("a", "b")}[leader]
    other = "b" if frozen == "a" else "a"
    procs.freeze(peers[frozen])
    t0, before_freeze = time.monotonic(), run.made()
    wait_until(lambda: run.made(other) > before_freeze, "a version from the other learner", 120, run.alive())
    timeline["takeover_after_leader_froze_s"] = time.monotonic() - t0
    run.advance(3, "from the other learner while the leader is frozen", by=(other,))
    procs.thaw(peers[frozen])
    wait_until(
        lambda: watch.leading.get(leader) is False and watch.leader() == run.peer_id(other),
        "the thawed learner helping the new leader",
        90,
        run.alive(),
    )
    run.advance(3, "with the thawed learner helping")

    # both learners die at once (between checkpoints); one comes back and resumes from its checkpoint + journal
    own = [line for line in read_ledger(run.ledgers["a"]) if not line.get("no_signal")][-1]  # what "a" held last
    for name in ("a", "b"):
        procs.kill_group(peers.pop(name))
    rollout_ids = [run.peer_id(name) for name in ("r2", "r3")]
    killed_at = time.time()
    wait_until(  # each rollout peer lives on and heartbeats a full interval after its learners died
        lambda: all(watch.last_seen.get(p, 0.0) > killed_at + HEARTBEAT_INTERVAL for p in rollout_ids),
        "a heartbeat from each rollout peer a heartbeat interval after both learners died",
        60,
        [peers["r2"], peers["r3"]],
    )
    t0 = time.monotonic()
    run.learner("a", "a2")  # the same identity, cache and checkpoint directory as "a"
    run.advance(3, "from the restarted learner", 180)
    timeline["restart_to_3_versions_s"] = time.monotonic() - t0

    summaries = run.stop("r2", "r3", "a2")
    resumed = summaries["a2"]
    assert resumed["resumed_from"].startswith("checkpoint"), resumed  # its own checkpoint and journal
    first_after = next(line for line in read_ledger(run.ledgers["a2"]) if not line.get("no_signal"))
    assert (first_after["version"], first_after["parent_sha256"]) == (own["version"] + 1, own["sha256"])
    timeline.update(run.check_one_lineage(resumed), resumed_from=resumed["resumed_from"])
    (tmp_path / "faults.json").write_text(json.dumps(timeline))  # the figures docs/reliability.md reports


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_frozen_helper_and_a_helper_restarted_without_a_checkpoint_rejoin_the_lineage(tmp_path, procs, reader):
    run = Run(procs, tmp_path, reader, "faults2")
    for name in ("r1", "r2"):
        run.rollout(name)
    run.learner("a")
    run.advance(2, "from the first learner")
    run.learner("b")
    watch = run.watch
    wait_until(lambda: len(watch.leading) == 2 and watch.leader() is not None, "two learners, one leading", 90)
    run.advance(3, "from the team")
    leader = {run.peer_id(name): name for name in ("a", "b")}[watch.leader()]
    helper = "b" if leader == "a" else "a"
    timeline: dict = {}

    # the helper hangs: the leader stops waiting for it, and its versions are announced again without it
    procs.freeze(run.peers[helper])
    announced = run.made(leader)  # the leader's own ledger: every version announced later was made after this
    t0 = time.monotonic()
    wait_until(lambda: max(watch.announced, default=0) >= announced + 3, "announcements without the helper", 120)
    timeline["announcing_again_after_helper_froze_s"] = time.monotonic() - t0
    procs.thaw(run.peers[helper])
    thawed_at = run.made(leader)
    wait_until(lambda: run.made(helper) > thawed_at, "the thawed helper applying the leader's versions", 90)

    # the helper dies and comes back with no checkpoint: it takes the team's state from the leader
    procs.kill_group(run.peers.pop(helper))
    run.advance(2, "after the helper died", by=(leader,))
    run.learner(helper, f"{helper}2", checkpoint=False)
    wait_until(lambda: len(read_ledger(run.ledgers[f"{helper}2"])) >= 3, "3 steps applied by the restarted helper")

    summaries = run.stop("r1", "r2", leader, f"{helper}2")
    assert summaries[f"{helper}2"]["team"].get("states", 0) >= 1, summaries[f"{helper}2"]["team"]  # from its peers
    made = {n: {ln["version"]: ln["sha256"] for ln in read_ledger(run.ledgers[n])} for n in (leader, f"{helper}2")}
    common = set(made[leader]) & set(made[f"{helper}2"])
    assert len(common) >= 3 and all(made[leader][v] == made[f"{helper}2"][v] for v in common)
    timeline.update(run.check_one_lineage(summaries[leader]))
    (tmp_path / "faults2.json").write_text(json.dumps(timeline))
