"""The rollout peer in real processes: `hivegrpo host` + `hivegrpo join` on loopback, read back and verified here.

The test process is a third peer of the swarm: it reads the buckets, re-derives every prompt from its signer and
seq, recomputes every reward and (for a sample) the behaviour log-probs, and announces adapter v1 as a learner
would (with the host's learner credential), then checks that the rollout peer switches to it.
"""

import json
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.swarm import LOOPBACK, model_copy
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.timeout(280)
def test_rollout_peer_publishes_verifiable_groups_and_follows_a_new_adapter(tmp_path, procs, reader):
    from peer.model.adapter import adapter_to_bytes, attach_lora, lora_parameters, sha256_hex
    from peer.model.config import ModelConfig
    from peer.model.loading import load_base
    from peer.network.buckets import DHTBucketStore
    from peer.network.heartbeat import live_peers
    from peer.protocol import key_fingerprint
    from peer.roles.learner.verify import check_group, check_logprobs
    from peer.run.adapters import announce_adapter
    from peer.run.spec import read_manifest, run_spec

    info_file = tmp_path / "info.json"
    model = model_copy(tmp_path)  # named by its folder only: the rollout peer must fetch it over P2P
    host = procs.start(
        "host",
        "host",
        "--run-id",
        "roll",
        "--model",
        str(model),
        "--cache-dir",
        str(tmp_path / "host"),
        "--info-file",
        str(info_file),
        "--groups-per-version",
        "8",
        "--max-new-tokens",
        "7",
        "--temperature",
        "0.9",
        *LOOPBACK,
    )
    wait_until(info_file.exists, "the host's info file", watched_processes=[host])
    info = json.loads(info_file.read_text())
    rollout = procs.start(
        "rollout",
        "join",
        "--run-id",
        "roll",
        "--coordinator",
        info["coordinator"],
        *[a for m in info["initial_peers"] for a in ("--initial-peers", m)],
        "--cache-dir",
        str(tmp_path / "r"),
        "--batch-size",
        "4",
        "--max-inflight",
        "8",
        "--ledger",
        str(tmp_path / "rollout.jsonl"),
        "--json",
        *LOOPBACK,
    )
    swarm, blobs = reader("roll", info["initial_peers"])
    manifest, key = read_manifest(swarm, info["coordinator"])
    spec = run_spec(manifest, key)
    assert manifest.model.name == "tiny-copy"
    assert (spec.sampling.max_new_tokens, spec.sampling.temperature) == (7, 0.9)  # the host's flags
    base = load_base(ModelConfig(name=str(model), quantization=manifest.model.quantization, device="cpu"))
    policy = attach_lora(base.model, spec.lora)
    v0 = adapter_to_bytes(policy)
    assert sha256_hex(v0) == manifest.adapter0_sha256
    adapters = {0: manifest.adapter0_sha256}
    store = DHTBucketStore(swarm, blobs)

    # version 0: the peer fills the bucket up to --max-inflight, then waits (backpressure)
    wait_until(lambda: store.count(0, 0) >= 8, "8 groups of v0", watched_processes=[host, rollout])
    wait_until(
        lambda: "8 groups of v0 wait for the learners; pausing" in procs.log(rollout),
        "the rollout peer pausing on a full bucket",
        60,
        [host, rollout],
    )
    made = [json.loads(line) for line in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    assert sum(x["groups"] for x in made if x["kind"] == "batch") == 8, "it generated past --max-inflight"
    assert store.count(0, 0) == 8
    fetched = store.fetch(0, 0)
    assert len(fetched) == 8 and all(f.error is None for f in fetched), [f.error for f in fetched]
    assert sorted(f.seq for f in fetched) == list(range(8))
    for f in fetched:
        assert check_group(f.group, f.owner, spec, base.tokenizer, adapters.get) is None
        assert f.group.adapter_sha256 == adapters[0] and len(f.group.completions) == spec.sampling.group_size
        assert max(len(c.tokens()) for c in f.group.completions) <= 7
    rewards = [r for f in fetched for r in f.group.rewards]
    assert 0.0 < sum(rewards) / len(rewards) < 1.0  # the bundled model is right about a third of the time
    assert check_logprobs(policy, fetched[0].group, spec, tolerance=2e-3) is None

    # a learner (admitted by the host's credential) announces v1: the peer hot-swaps, its next groups carry v1
    from peer.network.admission import parse_credential, publish_admission

    assert publish_admission(swarm, parse_credential(info["learner_credential"]))
    with_noise = [p.data.add_(0.05 * p.data.abs().mean().clamp(min=1e-3)) for p in lora_parameters(policy)]
    assert with_noise
    v1 = adapter_to_bytes(policy)
    adapters[1] = sha256_hex(v1)
    announced = announce_adapter(swarm, blobs, 1, v1, adapters[0])
    wait_until(lambda: store.count(1, 1) >= 8, "8 groups of v1", watched_processes=[host, rollout])
    fetched = store.fetch(1, 1)
    for f in fetched:
        assert f.group.version == 1 and f.group.adapter_sha256 == adapters[1]
        assert check_group(f.group, f.owner, spec, base.tokenizer, adapters.get) is None
    assert min(f.seq for f in fetched) >= 8  # new prompts, never a replay of v0's
    assert check_logprobs(policy, fetched[0].group, spec, tolerance=2e-3) is None
    beats = wait_until(
        lambda: [p for p in live_peers(swarm, "rollout") if p.record.adapter_version == 1],
        "the rollout heartbeat at v1",
        timeout=30,
    )
    assert beats[0].record.throughput > 0

    # SIGTERM: stops after the batch, announces leaving, exits 0 with its summary
    rollout.send_signal(signal.SIGTERM)
    out, _ = rollout.communicate(timeout=60)
    assert rollout.returncode == 0, procs.log(rollout)[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["versions_used"] == [0, 1] and summary["publish_failed"] == 0
    assert summary["published"] == summary["groups"] >= 16

    # its ledger: who it is, every batch, the swap with the bytes it moved
    ledger = [json.loads(line) for line in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    start, batches = ledger[0], [x for x in ledger if x["kind"] == "batch"]
    assert start["kind"] == "start" and start["peer_id"] == summary["peer_id"] and start["version"] == 0
    assert start["signer"] == key_fingerprint(fetched[0].owner)
    assert sum(b["groups"] for b in batches) == summary["groups"] and all(b["sample_seconds"] > 0 for b in batches)
    assert sum(b["tokens"] for b in batches) == summary["tokens"] > 0
    (swap,) = [x for x in ledger if x["kind"] == "swap"]
    assert swap["version"] == 1 and swap["held"] == 0 and swap["announced"] == announced.created
    assert swap["size"] == len(v1) and swap["fetched_bytes"] == len(v1) and swap["fetches"] == 1
    assert [b["version"] for b in batches] == sorted(b["version"] for b in batches)
    leaving = wait_until(
        lambda: [p for p in live_peers(swarm, "rollout", include_leaving=True) if p.record.state == "leaving"],
        "the rollout peer's leaving heartbeat",
        timeout=30,
    )
    assert leaving[0].record.peer_id == summary["peer_id"]
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=60)
    assert host.returncode == 0, procs.log(host)[-3000:]


def _publish_manifest(swarm, blobs, manifest) -> None:
    from peer.protocol import manifest_key, owner_subkey, to_dht_value

    assert swarm.store(
        manifest_key(swarm.run_id), owner_subkey(swarm.public_key), to_dht_value(manifest), time.time() + 300, "m"
    )


def _join_fails(procs, tmp_path, run_id, initial_peers, cache: Path) -> str:
    p = procs.start(
        f"join-{run_id}",
        "join",
        "--run-id",
        run_id,
        *[a for m in initial_peers for a in ("--initial-peers", m)],
        "--cache-dir",
        str(cache),
        *LOOPBACK,
    )
    p.communicate(timeout=120)
    log = procs.log(p)
    assert p.returncode == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, log[-3000:]
    return errors[0]


def _cache_holds_nothing_for(cache: Path, sha256: str) -> None:
    from peer.network.blobs.cache import BlobCache

    assert not BlobCache(cache / "blobs").has(sha256)
    models = cache / "models"
    assert not models.exists() or not any(models.iterdir()), list(models.iterdir())


@pytest.mark.timeout(280)
def test_bad_manifests_end_in_one_clear_error_and_leave_no_model_behind(tmp_path, procs, reader):
    from coordinator.manifest import RunSettings, build_manifest
    from peer.protocol import TaskSpec

    folder = model_copy(tmp_path)
    good = build_manifest(
        RunSettings(run_id="badtask", model=str(folder)),
        folder,
        "0" * 64,
        "12D3KooWQxzDHbPHdvWj5HXFfMVFtN1VbGNMW2GfRhDKVo2RFhdT",
    )

    # 1. a task nobody can build
    swarm, blobs = reader("badtask")
    _publish_manifest(swarm, blobs, good.copy(update={"task": TaskSpec(name="no-such-task", config_json="{}")}))
    error = _join_fails(procs, tmp_path, "badtask", swarm.visible_maddrs(), tmp_path / "c1")
    assert "task" in error and "no-such-task" in error, error

    # 2. a model that no peer serves and that is no hub id
    swarm2, blobs2 = reader("ghost")  # a swarm of its own: peers refuse keys of other runs
    ghost = good.copy(update={"run_id": "ghost", "model": good.model.copy(update={"name": "ghost-model"})})
    _publish_manifest(swarm2, blobs2, ghost)
    error = _join_fails(procs, tmp_path, "ghost", swarm2.visible_maddrs(), tmp_path / "c2")
    assert "no source has base model file" in error and "ghost-model" in error, error
    _cache_holds_nothing_for(tmp_path / "c2", good.model.files[0].sha256)

    # 3. the served weights no longer hash to the manifest's sha256 (the host's file changed under it)
    swarm3, blobs3 = reader("changed")
    changed = good.copy(update={"run_id": "changed"})
    for f in changed.model.files:
        blobs3.cache.adopt(folder / f.path, sha256=f.sha256)
    weights = next(f for f in changed.model.files if f.path == "model.safetensors")
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(weights.size // 2)
        f.write(b"\xff" * 64)
    _publish_manifest(swarm3, blobs3, changed)
    from peer.network.heartbeat import Heartbeat

    beat = Heartbeat(swarm3, "coordinator").start()  # so the rollout peer asks this peer for the files
    try:
        error = _join_fails(procs, tmp_path, "changed", swarm3.visible_maddrs(), tmp_path / "c3")
    finally:
        beat.stop()
    assert "model.safetensors" in error and weights.sha256[:12] in error, error
    _cache_holds_nothing_for(tmp_path / "c3", weights.sha256)
