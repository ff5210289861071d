"""The learner in real processes: `hivegrpo host` + `join` (+ lying joins) + `learn` on loopback.

The test process is one more peer of the swarm: it reads the adapter announcements, the buckets and the learners'
metrics, fetches the announced adapters over P2P, and checks them against the learner's ledger (one JSON line per
update, listing the ``[signer fingerprint, version, seq]`` of every group the update used).
"""

import json
import re
import signal
from pathlib import Path

import pytest

from tests.helpers.swarm import exit_summary, fingerprint, join_args, learn_args, start_host
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration

LIAR = str(Path(__file__).parents[1] / "procs" / "liar_rollout.py")


def _ledger(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _announced(swarm) -> dict[int, set[str]]:
    from peer.run.adapters import announcements

    out: dict[int, set[str]] = {}
    for _, record in announcements(swarm):
        out.setdefault(record.version, set()).add(record.sha256)
    return out


@pytest.mark.timeout(300)
def test_one_rollout_peer_and_one_learner_make_versions_the_rollout_peer_follows(tmp_path, procs, reader):
    from safetensors.torch import load as load_tensors

    from peer.model.adapter import adapter_to_bytes, attach_lora, sha256_hex
    from peer.model.config import ModelConfig
    from peer.model.loading import load_base
    from peer.network.blobs.cache import BlobCache
    from peer.run.adapters import announcements
    from peer.run.spec import read_manifest, run_spec

    host, info = start_host(procs, tmp_path, "learn1", "--groups-per-version", "4", "--tau-max", "3")
    rollout = procs.start(
        "rollout",
        "join",
        *join_args(info),
        "--cache-dir",
        str(tmp_path / "r"),
        "--batch-size",
        "4",
        "--max-inflight",
        "4",
        "--ledger",
        str(tmp_path / "rollout.jsonl"),
    )  # few groups ahead of the learner: the peer must follow the versions it makes
    ledger, checkpoints = tmp_path / "ledger.jsonl", tmp_path / "ckpt"
    learn = [*learn_args(info), "--cache-dir", str(tmp_path / "l"), "--checkpoint-dir", str(checkpoints)]
    learner = procs.start("learner", "learn", *learn, "--max-versions", "4", "--ledger", str(ledger), "--json")
    summary = exit_summary(learner)
    assert summary["versions_made"] == 4 and summary["adapter_version"] == 4, summary
    assert summary["groups_rejected"] == {} and summary["banned"] == [], summary

    swarm, _ = reader("learn1", info["initial_peers"])
    manifest, key = read_manifest(swarm, info["coordinator"])
    assert run_spec(manifest, key).staleness.tau_max == 3, "hivegrpo host --tau-max reaches the manifest"

    # the ledger: versions 1..4, each the child of the one before, every group used once
    lines = _ledger(ledger)
    made = [line for line in lines if not line.get("no_signal")]
    assert [line["version"] for line in made] == [1, 2, 3, 4]
    parents = [manifest.adapter0_sha256] + [line["sha256"] for line in made[:-1]]
    assert [line["parent_sha256"] for line in made] == parents
    ids = [tuple(i) for line in lines for i in line["ids"]]
    assert len(ids) == len(set(ids)) and all(line["groups"] == 4 for line in lines)
    assert all(line["staleness_max"] <= 3 for line in lines), "nothing older than the run's tau_max"
    sha = {0: manifest.adapter0_sha256, **{line["version"]: line["sha256"] for line in made}}
    assert summary["adapter_sha256"] == sha[4]

    # what was announced is that lineage; the adapters hold LoRA weights only, the same tensors as v0, changed
    announced = wait_until(lambda: (a := _announced(swarm)).get(4) and a, "the learner's v4 announcement")
    assert announced[4] == {sha[4]}
    record = next(r for _, r in announcements(swarm) if r.version == 4)
    learner_cache = BlobCache(tmp_path / "l" / "blobs")  # the learner has exited: its cache is what it served
    assert record.sha256 == sha[4] and learner_cache.verify(sha[4])
    v4 = load_tensors(learner_cache.path(sha[4]).read_bytes())
    base = load_base(ModelConfig(name="bundled", quantization=manifest.model.quantization, device="cpu"))
    v0_blob = adapter_to_bytes(attach_lora(base.model, run_spec(manifest, key).lora))  # built here, independently
    assert sha256_hex(v0_blob) == sha[0]
    v0 = load_tensors(v0_blob)
    assert set(v4) == set(v0) and v4 and all("lora_" in name for name in v4), sorted(v4)[:4]
    assert any(not (v4[n] == v0[n]).all() for n in v4), "the adapter did not move"
    # the learner's copy of the base model files still hashes to the manifest (nothing wrote to them)
    for f in manifest.model.files:
        assert learner_cache.has(f.sha256) and learner_cache.verify(f.sha256), f.path

    # the rollout peer generated with the versions the learner made, swapped in with their exact sha256 (the
    # learner took its entries itself, so they left with it; the groups' own tags were checked by its intake, which
    # refuses a tag that is not its version's: groups_rejected is empty above)
    rollout_lines = _ledger(tmp_path / "rollout.jsonl")
    sampled = {line["version"] for line in rollout_lines if line["kind"] == "batch"}
    swapped = {line["version"]: line["sha256"] for line in rollout_lines if line["kind"] == "swap"}
    # (paced to the learner's demand it samples ahead with the version it holds: it may skip one of them)
    assert 0 in sampled and len(sampled & {1, 2, 3, 4}) >= 2, sampled
    assert set(swapped) >= sampled - {0} and all(swapped[v] == sha[v] for v in swapped), (swapped, sha)

    # restarted with the same checkpoint directory: resumes at v4 (not from scratch), ends at v6
    learner = procs.start(
        "learner2", "learn", *learn, "--max-versions", "2", "--ledger", str(tmp_path / "l2.jsonl"), "--json"
    )
    again = exit_summary(learner)
    assert again["adapter_version"] == 6 and again["versions_made"] == 2, again
    assert again["resumed_from"] == f"checkpoint {checkpoints}", again
    first = next(line for line in _ledger(tmp_path / "l2.jsonl") if not line.get("no_signal"))
    assert first["version"] == 5 and first["parent_sha256"] == sha[4]
    used_again = {tuple(i) for line in _ledger(tmp_path / "l2.jsonl") for i in line["ids"]}
    assert not used_again & set(ids), "a group counted in two updates across the restart"

    rollout.send_signal(signal.SIGTERM)
    rollout.communicate(timeout=60)
    assert rollout.returncode == 0, procs.log(rollout)[-3000:]
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=60)
    assert host.returncode == 0, procs.log(host)[-3000:]


@pytest.mark.timeout(300)
def test_a_peer_that_inflates_rewards_or_replays_a_group_is_banned_and_never_reaches_an_update(
    tmp_path, procs, reader
):
    from peer.protocol import MetricsRecord, from_dht_value, metrics_key

    host, info = start_host(procs, tmp_path, "liars", "--groups-per-version", "4")
    rollout = ["--batch-size", "4"]
    procs.start("honest", "join", *join_args(info), "--cache-dir", str(tmp_path / "h"), *rollout)
    names = {}
    for mode in ("inflate", "replay"):
        identity = tmp_path / f"{mode}.id"
        names[mode] = fingerprint(identity)
        args = ["join", *join_args(info), "--cache-dir", str(tmp_path / mode), "--identity", str(identity), *rollout]
        names[f"{mode}-proc"] = procs.start_argv(mode, [LIAR, mode, *args])
    ledger = tmp_path / "ledger.jsonl"
    learner = procs.start(
        "learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"), "--ledger", str(ledger), "--json"
    )
    swarm, _ = reader("liars", info["initial_peers"])

    def metrics_banned() -> set[str]:
        found = set()
        for item in swarm.get_dict(metrics_key("liars")).values():
            found.update(from_dht_value(MetricsRecord, item.value).banned)
        return found

    wait_until(
        lambda: {names["inflate"], names["replay"]} <= metrics_banned(),
        "both liars in the learner's metrics",
        timeout=200,
        watched_processes=[learner],
    )
    learner.send_signal(signal.SIGTERM)
    summary = exit_summary(learner)
    assert {names["inflate"], names["replay"]} <= set(summary["banned"]), summary
    assert summary["groups_rejected"].get("reward", 0) >= 1 and summary["groups_rejected"].get("replay", 0) >= 1
    assert summary["versions_made"] >= 2

    lines = _ledger(ledger)
    ids = [tuple(i) for line in lines for i in line["ids"]]
    assert ids and len(ids) == len(set(ids))
    assert not [i for i in ids if i[0] == names["inflate"]], "an inflated group reached an update"
    replayed = re.search(r"replaying group (\d+)\.(\d+) as (\d+)\.(\d+)", procs.log(names["replay-proc"]))
    assert replayed, procs.log(names["replay-proc"])[-2000:]
    # whichever copy the learner read first is the one it may have used; the other is the replay, never used
    seq = int(replayed[2])
    assert len([i for i in ids if i[0] == names["replay"] and i[2] == seq]) <= 1, "a group counted twice"
    after_ban = [line for line in lines if names["replay"] in line["banned"]]
    assert after_ban, "the ban shows in the ledger"
    assert not [i for line in after_ban for i in line["ids"] if i[0] == names["replay"]], "used after its ban"
    banned_from = next(k for k, line in enumerate(lines) if names["replay"] in line["banned"])
    after = [i for line in lines[banned_from:] for i in line["ids"] if i[0] == names["replay"]]
    assert after == [], "a group of the replaying peer reached an update after its ban"
    assert any(i[0] not in (names["inflate"], names["replay"]) for i in ids), "the honest peer's groups were used"
    host.send_signal(signal.SIGTERM)
    host.communicate(timeout=60)
