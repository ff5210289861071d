"""Corrupt blobs in real processes: two peers serve bit-flipped and truncated copies of the base model's files and
of every adapter version, next to honest providers. A rollout peer joining then must reject every corrupt
transfer, get each blob from an honest provider, and load nothing corrupt — shown by a learner that recomputes the
behaviour log-probs of every one of its groups (``--check-rate 1``) and uses them. Model files come from the
coordinator the manifest names, which every peer asks first (a heartbeat's claim orders nothing:
tests/integration/test_sybils.py), so the mirrors' corrupt model files are never fetched while the host serves;
``tests/integration/test_blobs.py`` moves a blob past a corrupt and a truncating provider.

The mirrors hold the host's learner credential (admitted learners whose blob service is broken: a stranger's
announcements are ignored, tests/integration/test_strangers.py). The learner is stopped before the new peer joins, so
the newest adapter's announced providers are the dead learner and the two corrupt mirrors: all three fail and the
adapter comes from another live peer (the honest rollout peer followed it). The model folder holds 24 extra 2 KB files:
30 fetches, each of which a mirror asked first would have failed."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.swarm import fingerprint, join_args, learn_args, model_copy, read_ledger, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration

MIRROR = str(Path(__file__).parents[1] / "procs" / "corrupt_mirror.py")
FLIPPED = re.compile(r"provider (\S+) failed to deliver blob (\w+)…: sent bytes that do not match")
CUT = re.compile(r"provider (\S+) failed to deliver blob (\w+)…: (ended the data after|dropped the stream after)")


@pytest.mark.timeout(420)
def test_corrupt_and_truncated_copies_are_refused_and_nothing_corrupt_is_loaded(tmp_path, procs, reader):
    from peer.network.blobs import BlobCache

    folder = model_copy(tmp_path)
    for i in range(24):  # a model folder may hold more than the model (notes, licences): each file is a blob
        (folder / f"notes-{i:02d}.txt").write_bytes(os.urandom(2048))
    host, info = start_host(
        procs, tmp_path, "corrupt", "--model", str(folder), "--groups-per-version", "4", "--learners", "3"
    )
    net = join_args(info)
    rollout = ["--batch-size", "4", "--json"]
    honest = procs.start("honest", "join", *net, "--cache-dir", str(tmp_path / "a"), *rollout)
    ledger = tmp_path / "ledger.jsonl"
    learn = [
        "learn",
        *learn_args(info),
        "--cache-dir",
        str(tmp_path / "l"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    learner = procs.start("learner", *learn, "--ledger", str(ledger), "--json")
    mirrors = {}
    for i, mode in enumerate(("flip", "truncate"), 1):
        args = [MIRROR, mode, *net, "--cache-dir", str(tmp_path / mode), "--identity", str(tmp_path / f"{mode}.id")]
        args += ["--learner-credential", info["learner_credentials"][i]]  # admitted, so that followers ask it
        mirrors[mode] = procs.start_argv(mode, args)
    wait_until(
        lambda: all("holding the base model" in procs.log(m) for m in mirrors.values()),
        "the mirrors holding the base model",
        120,
        [host, honest, learner, *mirrors.values()],
    )
    swarm, _ = reader("corrupt", info["initial_peers"])
    model_shas = {f.sha256[:12] for f in _manifest_files(swarm, info)}
    assert len(model_shas) == 30

    def mirrored() -> bool:
        from peer.run.adapters import announcements, newest_announcement

        found = newest_announcement(announcements(swarm))
        return found is not None and found.version >= 3 and found.announcers == 3

    def all_announcing() -> bool:  # while versions come, the newest is often announced by the learner alone
        from peer.run.adapters import announcements

        return sum(1 for _, record in announcements(swarm) if record.version >= 3) == 3

    wait_until(all_announcing, "the learner and both mirrors announcing a version >= 3", 120, [learner, honest])
    # the learner's last version must reach the mirrors before it leaves (once it is gone, they could only fetch
    # it from each other, corrupt): no new groups, so no new versions, then it stops
    honest.send_signal(signal.SIGSTOP)
    try:
        quiet = [len(read_ledger(ledger)), time.time()]

        def settled() -> bool:
            made = len(read_ledger(ledger))
            if made != quiet[0]:
                quiet[:] = [made, time.time()]
            return time.time() - quiet[1] >= 3.0 and mirrored()

        wait_until(settled, "the learner's last version announced by both mirrors", 60, [learner])
        learner.send_signal(signal.SIGTERM)
        assert json.loads(learner.communicate(timeout=90)[0].strip().splitlines()[-1])["versions_made"] >= 3
    finally:
        honest.send_signal(signal.SIGCONT)
    wait_until(mirrored, "the newest version still announced by all three", 30)

    # a new peer joins: its base model and adapter must come through the corrupt providers
    new_id = tmp_path / "new.id"
    new = procs.start("new", "join", *net, "--cache-dir", str(tmp_path / "new"), "--identity", str(new_id), *rollout)
    wait_until(lambda: "rollout peer ready" in procs.log(new), "the new peer ready", 180, [new, honest])
    # a learner again, which recomputes the log-probs of every group: the new peer's must match its own model
    learner = procs.start("learner2", *learn, "--ledger", str(ledger), "--check-rate", "1", "--json")
    mine = fingerprint(new_id)
    wait_until(
        lambda: sum(1 for line in read_ledger(ledger) for i in line.get("ids", []) if i[0] == mine) >= 8,
        "the new peer's groups in updates",
        180,
        [learner, new, honest],
    )
    for p in (new, honest, learner, *mirrors.values()):
        p.send_signal(signal.SIGTERM)
    summary = json.loads(new.communicate(timeout=90)[0].strip().splitlines()[-1])
    checked = json.loads(learner.communicate(timeout=90)[0].strip().splitlines()[-1])
    for p in (honest, *mirrors.values()):
        p.communicate(timeout=90)
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=90)

    log = procs.log(new)
    assert new.returncode == 0, log[-3000:]
    flipped, cut = FLIPPED.findall(log), CUT.findall(log)
    mirror_ids = {_peer_id(tmp_path / f"{mode}.id") for mode in ("flip", "truncate")}
    assert {p for p, _ in flipped} | {p for p, _, _ in cut} <= mirror_ids, "an honest provider was refused"
    assert not any(sha in model_shas for _, sha in flipped + [c[:2] for c in cut]), "model files: the host first"
    assert any(sha not in model_shas for _, sha in flipped) and any(sha not in model_shas for _, sha, _ in cut)
    # nothing unverified in the cache, and what it loaded is what the learner recomputes
    cache = BlobCache(tmp_path / "new" / "blobs")
    held = cache.list()
    assert model_shas <= {sha[:12] for sha in held} and all(cache.verify(sha) for sha in held)
    assert mine not in checked["banned"] and checked["groups_rejected"].get("logprobs", 0) == 0, checked
    assert checked["logprob_checks"] >= 8
    assert summary["adapter_version"] > 0 and summary["published"] >= 8
    (tmp_path / "corrupt.json").write_text(  # the figures docs/reliability.md reports
        json.dumps({"flipped_refused": len(flipped), "truncated_refused": len(cut), "blobs_cached": len(held)})
    )


def _peer_id(identity: Path) -> str:
    from hivemind.p2p import PeerID

    return PeerID.from_identity(identity.read_bytes()).to_base58()


def _manifest_files(swarm, info: dict):
    from peer.run.spec import read_manifest

    manifest, _ = read_manifest(swarm, info["coordinator"])
    return manifest.model.files
