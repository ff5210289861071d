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

from tests.swarm_helpers import fingerprint, join_args, read_ledger, start_host, wait_until

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
        from peer.roles.adapters import announcements

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


def _summary(proc) -> dict:
    out, _ = proc.communicate(timeout=90)
    return json.loads(out.strip().splitlines()[-1])


def _lineage(ledgers: list[list[dict]], head: str) -> list[dict]:
    """The chain of versions from v1 to ``head`` (a sha256), from whichever ledger lines name them."""
    by_sha = {line["sha256"]: line for lines in ledgers for line in lines if not line.get("no_signal")}
    chain = []
    while head in by_sha:
        chain.append(by_sha[head])
        head = by_sha[head]["parent_sha256"]
    return chain[::-1]


@pytest.mark.timeout(600)
def test_a_swarm_goes_on_through_dead_and_frozen_peers_and_loses_no_version(tmp_path, procs, reader):
    host, info = start_host(procs, tmp_path, "faults", "--groups-per-version", "4", new_session=True)
    net = join_args(info)

    def learner(name: str, ledger: Path, label: str | None = None):
        args = ["learn", *net, "--cache-dir", str(tmp_path / name), "--checkpoint-dir", str(tmp_path / f"{name}.ckpt")]
        args += ["--identity", str(tmp_path / f"{name}.id"), "--ledger", str(ledger), "--json"]
        return procs.start(label or name, *args, new_session=True)

    def rollout(name: str):
        args = ["join", *net, "--cache-dir", str(tmp_path / name), "--identity", str(tmp_path / f"{name}.id")]
        return procs.start(name, *args, "--batch-size", "4", "--json", new_session=True)

    fp = {name: fingerprint(tmp_path / f"{name}.id") for name in ("r1", "r2", "r3")}
    ledgers = {name: tmp_path / f"{name}.jsonl" for name in ("a", "b", "a2", "b2")}
    peers = {"r1": rollout("r1"), "r2": rollout("r2"), "r3": rollout("r3"), "a": learner("a", ledgers["a"])}
    swarm, _ = reader("faults", info["initial_peers"])
    watch = Watch(swarm).start()

    def alive():
        return [p for p in peers.values() if p is not None and p.pid not in procs.frozen]

    def made(*names: str) -> int:
        """The newest version in these learners' ledgers (their own files: read now, no network in between)."""
        return max((line["version"] for n in names for line in read_ledger(ledgers[n])), default=0)

    def advance(n: int, what: str, timeout: float = 120.0, by: tuple[str, ...] = ("a", "b", "a2")) -> int:
        start = made("a", "b", "a2")
        wait_until(lambda: made(*by) >= start + n, f"{n} more versions {what}", timeout, alive())
        return made(*by)

    def peer_id(name: str) -> str:
        from hivemind.p2p import PeerID

        identity = tmp_path / f"{name}.id"
        wait_until(identity.exists, f"{name}'s identity file", 60)
        return PeerID.from_identity(identity.read_bytes()).to_base58()

    timeline: dict = {}
    advance(2, "from the first learner")
    peers["b"] = learner("b", ledgers["b"])
    wait_until(lambda: len(watch.leading) == 2 and watch.leader() is not None, "two learners, one leading", 90)
    advance(3, "from the team")

    # a rollout peer dies
    procs.kill_group(peers.pop("r1"))
    advance(3, "after a rollout peer died")
    timeline["rollout_killed"] = 1

    # a rollout peer hangs, then comes back: its groups are used again
    procs.freeze(peers["r2"])
    advance(2, "while a rollout peer is frozen")
    time.sleep(12.0)
    procs.thaw(peers["r2"])
    thawed_at = made("a", "b")

    def r2_used_after_thaw() -> bool:
        lines = [line for name in ("a", "b") for line in read_ledger(ledgers[name])]
        return any(i[0] == fp["r2"] for line in lines if line["version"] > thawed_at for i in line.get("ids", []))

    wait_until(r2_used_after_thaw, "the thawed rollout peer's groups in an update", 120, alive())

    # the coordinator hangs: nobody needs it
    procs.freeze(host)
    t0 = time.monotonic()
    advance(3, "while the coordinator is frozen")
    timeline["3_versions_with_coordinator_frozen_s"] = time.monotonic() - t0
    procs.thaw(host)

    # the leading learner hangs: the other takes over; thawed, the first helps the second
    leader = watch.leader()
    assert leader is not None, watch.leading
    by_id = {peer_id(name): name for name in ("a", "b")}
    frozen_name = by_id[leader]
    other = "b" if frozen_name == "a" else "a"
    procs.freeze(peers[frozen_name])
    t0, before_freeze = time.monotonic(), made("a", "b")
    wait_until(lambda: made(other) > before_freeze, "a version from the other learner", 120, alive())
    timeline["takeover_after_leader_froze_s"] = time.monotonic() - t0
    advance(3, "from the other learner while the leader is frozen", by=(other,))
    procs.thaw(peers[frozen_name])
    wait_until(
        lambda: watch.leading.get(leader) is False and watch.leader() == peer_id(other),
        "the thawed learner helping the new leader",
        90,
        alive(),
    )
    advance(3, "with the thawed learner helping")

    # both learners die at once (between checkpoints); one comes back and resumes from its checkpoint + journal
    own = [line for line in read_ledger(ledgers["a"]) if not line.get("no_signal")][-1]  # what "a" held last
    for name in ("a", "b"):
        procs.kill_group(peers.pop(name))
    before = {p: watch.last_seen.get(p, 0.0) for p in watch.last_seen}
    time.sleep(12.0)
    rollout_ids = [peer_id(name) for name in ("r2", "r3")]
    assert all(peers[name].poll() is None for name in ("r2", "r3")), "a rollout peer exited without its learners"
    assert any(watch.last_seen.get(p, 0.0) > before.get(p, 0.0) for p in rollout_ids), "rollout peers went silent"
    t0 = time.monotonic()
    peers["a2"] = learner("a", ledgers["a2"], "a2")  # the same identity, cache and checkpoint directory as "a"
    advance(3, "from the restarted learner", 180)
    timeline["restart_to_3_versions_s"] = time.monotonic() - t0

    # stop everything cleanly
    for name in ("r2", "r3", "a2"):
        peers[name].send_signal(signal.SIGTERM)
    summaries = {name: _summary(peers[name]) for name in ("r2", "r3", "a2")}
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=90)
    watch.stop()
    assert all(peers[name].returncode == 0 for name in ("r2", "r3", "a2")), {n: p.returncode for n, p in peers.items()}
    assert host.returncode == 0, procs.log(host)[-2000:]

    # the resumed learner started where the lineage was, from its own checkpoint and journal
    resumed = summaries["a2"]
    assert resumed["resumed_from"].startswith("checkpoint"), resumed
    first_after = next(line for line in read_ledger(ledgers["a2"]) if not line.get("no_signal"))
    assert (first_after["version"], first_after["parent_sha256"]) == (own["version"] + 1, own["sha256"])

    # one lineage: nothing announced twice with different bytes, nothing announced lost, every group used once
    forks = {v: shas for v, shas in watch.announced.items() if len(shas) > 1}
    assert not forks, f"versions announced with two adapters: {forks}"
    lines = [read_ledger(path) for path in ledgers.values()]
    chain = _lineage(lines, resumed["adapter_sha256"])
    assert [line["version"] for line in chain] == list(range(1, resumed["adapter_version"] + 1))
    on_chain = {(line["version"], line["sha256"]) for line in chain}
    lost = {(v, sha) for v, shas in watch.announced.items() for sha in shas if v > 0 and (v, sha) not in on_chain}
    assert not lost, f"announced versions that are not in the final lineage: {sorted(lost)}"
    ids = [tuple(i) for line in chain for i in line["ids"]]
    assert len(ids) == len(set(ids)), "a group used by two versions of the lineage"
    # no peer's version ever went backwards
    for peer_id, versions in watch.versions.items():
        held = [v for v in versions if v >= 0]  # -1: starting, nothing held yet (the restarted learner)
        assert held == sorted(held), f"{peer_id} went from one version back to an older one: {versions}"
    # the thawed rollout peer was not banned; its stale groups were dropped, not refused
    banned = {b for line in chain for b in line["banned"]}
    assert not banned, f"honest peers banned: {banned}"
    assert watch.errors < 10
    timeline.update(
        versions=resumed["adapter_version"],
        announced_versions_seen=len(watch.announced),
        forks=len(forks),
        announced_lost=len(lost),
        groups_used=len(ids),
        groups_used_twice=len(ids) - len(set(ids)),
        resumed_from=resumed["resumed_from"],
    )
    (tmp_path / "faults.json").write_text(json.dumps(timeline))  # the figures docs/reliability.md reports
