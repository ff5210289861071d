"""Rollout-side logic without a network: batching groups into bucket entries, picking the newest adapter, the
sequence counter, the manifest and run spec, getting the base model files, and checking a group before learning."""

import hashlib
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pydantic.v1 as pydantic
import pytest
import torch

from coordinator.manifest import RunSettings, build_manifest, published_name
from peer.errors import UserError
from peer.grpo.config import StalenessConfig
from peer.model.loading import bundled_path
from peer.network.blobs.cache import BlobCache, sha256_file
from peer.network.buckets import MemoryBucketStore, _count_of
from peer.protocol import (
    MAX_GROUPS_PER_ENTRY,
    MAX_INLINE_GROUP_BYTES,
    AdapterRecord,
    BucketEntry,
    Completion,
    GroupBatch,
    GroupRecord,
    ManifestRecord,
    ModelFile,
    ModelSpec,
    RecordError,
    TaskSpec,
    encode_floats,
    fits_inline,
    from_dht_value,
    groups_of,
    key_fingerprint,
    pack,
    split_batches,
    to_dht_value,
    unpack,
)
from peer.roles.learner.verify import REASONS, Refused, check_group, check_logprobs
from peer.roles.rollout.pacing import Backlog
from peer.roles.rollout.peer import _SeqCounter, build_groups, recent_rate
from peer.run.adapters import Announcement, newest_announcement
from peer.run.basemodel import ModelSourceError, model_files, resolve_base
from peer.run.spec import ManifestError, prompt_seed, run_spec
from tests.helpers.intake import sample_scored
from tests.helpers.records import PEER_ID, adapter_sha, changed, make_group

PEER_B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
PEER_C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
OWNER = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/owner=="
OTHER = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/other=="
SHA = adapter_sha(0)
SHA_X, SHA_Y, SHA_Z = "a" * 64, "b" * 64, "c" * 64


def group(version: int, seq: int, tokens: int = 5) -> GroupRecord:
    """Group ``seq`` of ``version``: four completions of ``tokens`` tokens each."""
    return make_group(version=version, seq=seq, completions=[[3 + i % 10] * tokens for i in range(4)])


def ids_of(batches):
    return [[(g.version, g.seq) for g in batch] for batch in batches]


def manifest(**settings) -> ManifestRecord:
    return build_manifest(RunSettings(run_id="r", **settings), bundled_path(), "0" * 64, PEER_ID)


# ---------------------------------------------------------------------------------------------------- batching


def test_split_batches_keeps_runs_of_one_version_and_consecutive_seqs():
    groups = [group(0, 0), group(0, 1), group(0, 2), group(0, 4), group(0, 5), group(1, 6), group(1, 7)]
    assert ids_of(split_batches(groups)) == [
        [(0, 0), (0, 1), (0, 2)],
        [(0, 4), (0, 5)],  # seq 3 is missing
        [(1, 6), (1, 7)],  # a new version, even though its seq follows
    ]


def test_split_batches_sorts_its_input():
    groups = [group(1, 1), group(0, 3), group(1, 0), group(0, 2), group(0, 1)]
    assert ids_of(split_batches(groups)) == [[(0, 1), (0, 2), (0, 3)], [(1, 0), (1, 1)]]
    assert split_batches([]) == []


def test_split_batches_caps_the_groups_per_entry():
    groups = [group(3, s) for s in range(MAX_GROUPS_PER_ENTRY + 6)]
    assert sum(len(pack(g)) for g in groups) < MAX_INLINE_GROUP_BYTES  # the count, not the bytes, splits them
    batches = split_batches(groups)
    assert [len(b) for b in batches] == [MAX_GROUPS_PER_ENTRY, 6]
    assert batches[1][0].seq == MAX_GROUPS_PER_ENTRY


def test_split_batches_splits_at_the_byte_budget():
    groups = [group(0, s) for s in range(5)]
    size = len(pack(groups[0]))
    assert {len(pack(g)) for g in groups} == {size}
    assert [len(b) for b in split_batches(groups, budget=2 * size)] == [2, 2, 1]
    assert [len(b) for b in split_batches(groups, budget=2 * size - 1)] == [1, 1, 1, 1, 1]
    # a group over the budget on its own still gets a batch of its own (it travels as a blob)
    assert ids_of(split_batches(groups[:2], budget=1)) == [[(0, 0)], [(0, 1)]]


def test_fits_inline_follows_the_packed_size():
    small, big, big2 = group(0, 0), group(0, 1, tokens=1000), group(0, 2, tokens=1000)
    assert fits_inline(small) and fits_inline([small, group(0, 1)]) and fits_inline(big)
    assert len(pack(big)) < MAX_INLINE_GROUP_BYTES < len(pack(big)) + len(pack(big2))
    assert not fits_inline([big, big2])
    assert ids_of(split_batches([small, big, big2])) == [[(0, 0), (0, 1)], [(0, 2)]]


def test_bucket_entry_round_trips_through_the_dht_value():
    groups = [group(2, 10), group(2, 11), group(2, 12)]
    entry = BucketEntry.of_groups(groups)
    assert (entry.version, entry.seq, entry.count, entry.pointer) == (2, 10, 3, None)
    value = to_dht_value(entry)
    back = from_dht_value(BucketEntry, value)
    assert back == entry and isinstance(back.inline, bytes)
    read = groups_of(back.inline, back.version, back.seq, back.count)
    assert read == groups and [g.seq for g in read] == [10, 11, 12]
    assert read[1].completions[0].tokens() == [3] * 5
    assert _count_of(value) == 3


@pytest.mark.parametrize(
    "groups",
    [[group(0, 0), group(0, 2)], [group(0, 0), group(1, 1)], [group(0, 1), group(0, 0)]],
    ids=["seq-gap", "mixed-versions", "descending"],
)
def test_bucket_entry_refuses_groups_that_are_not_one_run(groups):
    with pytest.raises(pydantic.ValidationError, match="consecutive seqs"):
        BucketEntry.of_groups(groups)
    with pytest.raises(pydantic.ValidationError, match="consecutive seqs"):
        GroupBatch(groups=groups)


@pytest.mark.parametrize(
    "field, value", [("count", 3), ("count", 1), ("seq", 11), ("version", 3)], ids=["count+", "count-", "seq", "ver"]
)
def test_bucket_entry_header_must_match_its_inline_groups(field, value):
    good = to_dht_value(BucketEntry.of_groups([group(2, 10), group(2, 11)]))
    entry = from_dht_value(BucketEntry, {**good, field: value})  # the DHT cannot tell: the groups are bytes there
    with pytest.raises(RecordError, match="their entry says"):
        groups_of(entry.inline, entry.version, entry.seq, entry.count)


def test_count_of_reads_only_a_sane_count():
    assert _count_of({"count": 7}) == 7
    assert _count_of({"count": MAX_GROUPS_PER_ENTRY}) == MAX_GROUPS_PER_ENTRY
    for junk in ({"count": 0}, {"count": MAX_GROUPS_PER_ENTRY + 1}, {"count": True}, {"count": 2.0}, {}, [3], None):
        assert _count_of(junk) == 1


def test_group_batch_packs_and_unpacks():
    batch = GroupBatch(groups=[group(4, 0), group(4, 1)])
    data = pack(batch)
    assert unpack(GroupBatch, data) == batch
    tampered = batch.dict()
    tampered["groups"] = [group(4, 0).dict(), group(4, 2).dict()]
    with pytest.raises(RecordError, match="consecutive seqs"):
        unpack(GroupBatch, msgpack.packb(tampered, use_bin_type=True))


def test_memory_store_publish_many_is_seen_group_by_group():
    shared = {}
    a = MemoryBucketStore(OWNER, shared)
    a.publish_many([group(1, 0), group(1, 1), group(2, 2)])
    got = MemoryBucketStore(OTHER, shared).fetch(1, 1)
    assert sorted((f.owner, f.version, f.seq) for f in got) == [(OWNER, 1, 0), (OWNER, 1, 1)]
    assert all(f.group is not None and f.group.seq == f.seq for f in got)
    assert a.count(1, 2) == 3


# ---------------------------------------------------------------------------------------------------- adapters


def announced(version, sha, *, providers, created, size=1000, parent=SHA_Z, learner=PEER_ID, ancestors=None):
    record = AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256="" if version == 0 else parent,
        ancestors=([] if version == 0 else [parent]) if ancestors is None else ancestors,
        size=size,
        providers=providers,
        created=created,
        learner=learner,
    )
    return (b"ssh-rsa " + learner.encode(), record)


def test_newest_announcement_picks_the_highest_version():
    records = [
        announced(1, SHA_X, providers=[PEER_B], created=1.0),
        announced(3, SHA_Y, providers=[PEER_C], created=5.0, size=77),
        announced(2, SHA_Z, providers=[PEER_B], created=9.0, parent=SHA_X),
        announced(0, SHA_X, providers=[PEER_ID], created=0.0),
    ]
    assert newest_announcement(records) == Announcement(3, SHA_Y, 77, (PEER_C,), 1, SHA_Z, created=5.0)


def test_newest_announcement_takes_the_sha_most_signers_announce():
    records = [
        announced(5, SHA_X, providers=[PEER_ID], created=1.0, learner=PEER_ID),  # earliest, but alone
        announced(5, SHA_Y, providers=[PEER_B, PEER_ID], created=2.0, learner=PEER_B),
        announced(5, SHA_Y, providers=[PEER_C, PEER_B], created=3.0, learner=PEER_C),
        announced(4, SHA_X, providers=[PEER_C], created=0.5, learner=PEER_C, parent=SHA_Y),
        announced(4, SHA_X, providers=[PEER_C], created=0.6, learner=PEER_ID, parent=SHA_Y),
    ]
    found = newest_announcement(records)
    assert (found.version, found.sha256, found.announcers) == (5, SHA_Y, 2)
    assert found.providers == (PEER_B, PEER_ID, PEER_C)  # the union, earliest announcer first, no repeats


def test_newest_announcement_breaks_a_tie_by_the_earliest():
    records = [
        announced(2, SHA_Y, providers=[PEER_B], created=8.0, learner=PEER_B),
        announced(2, SHA_X, providers=[PEER_C], created=4.0, learner=PEER_C),
    ]
    assert newest_announcement(records).sha256 == SHA_X
    assert newest_announcement(list(reversed(records))).sha256 == SHA_X


def test_newest_announcement_of_nothing_is_none():
    assert newest_announcement([]) is None


# ---------------------------------------------------------------------------------------------------- sequence numbers


def test_seq_counter_without_identity_counts_from_zero():
    counter = _SeqCounter(None, "r")
    assert counter.path is None
    assert counter.reserve(3) == range(0, 3)
    assert counter.reserve(1) == range(3, 4)
    assert counter.reserve(5) == range(4, 9)
    assert _SeqCounter(None, "r").reserve(2) == range(0, 2)  # nothing remembered


def test_seq_counter_resumes_after_a_restart(tmp_path):
    identity = str(tmp_path / "peer.key")
    first = _SeqCounter(identity, "run-a")
    assert first.reserve(4) == range(0, 4)
    assert first.reserve(2) == range(4, 6)
    assert json.loads((tmp_path / "peer.key.run-a.seq").read_text()) == {"next": 6}
    assert _SeqCounter(identity, "run-a").reserve(3) == range(6, 9)
    assert _SeqCounter(identity, "run-b").reserve(1) == range(0, 1)  # numbering is per run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer.key.run-a.seq", "peer.key.run-b.seq"]


@pytest.mark.parametrize("text", ["not json", "{}", "[]", '{"next": null}', '{"next": "x"}'])
def test_seq_counter_refuses_a_corrupt_file(tmp_path, text):
    (tmp_path / "peer.key.r.seq").write_text(text)
    with pytest.raises(UserError, match="delete it to start numbering afresh"):
        _SeqCounter(str(tmp_path / "peer.key"), "r")


# ---------------------------------------------------------------------------------------------------- run spec


def test_key_fingerprint_and_prompt_seed():
    assert key_fingerprint(OWNER) == hashlib.sha256(OWNER).hexdigest()[:16]
    assert key_fingerprint(OWNER) != key_fingerprint(OTHER)
    assert prompt_seed(0, OWNER) == prompt_seed(0, OWNER)
    assert len({prompt_seed(0, OWNER), prompt_seed(0, OTHER), prompt_seed(1, OWNER)}) == 3
    assert 0 <= prompt_seed(0, OWNER) < 2**63


def test_build_manifest_lists_the_bundled_files():
    m = manifest()
    assert m.model.name == "bundled" and m.model.quantization == "nf4" and m.model.revision is None
    files = {f.path: f for f in m.model.files}
    config = (bundled_path() / "config.json").read_bytes()
    assert files["config.json"].sha256 == hashlib.sha256(config).hexdigest()
    assert files["config.json"].size == len(config)
    assert "model.safetensors" in files
    assert m.coordinator == PEER_ID and m.adapter0_sha256 == "0" * 64
    spec = run_spec(m, OWNER)
    assert spec.run_id == "r" and spec.task.name == "addition" and spec.groups_per_version == 16
    assert spec.sampling == RunSettings(run_id="r").sampling
    assert spec.staleness == StalenessConfig() and spec.lora == RunSettings(run_id="r").lora


def test_published_name_of_a_local_folder_is_its_base_name(tmp_path):
    copy = tmp_path / "somewhere" / "my-model"
    shutil.copytree(bundled_path(), copy)
    assert published_name(str(copy), copy) == "my-model"
    assert published_name("bundled", bundled_path()) == "bundled"
    assert published_name("org/not-on-this-disk", tmp_path) == "org/not-on-this-disk"
    m = build_manifest(RunSettings(run_id="r", model=str(copy)), copy, "0" * 64, PEER_ID)
    assert m.model.name == "my-model"
    assert [f.path for f in m.model.files] == [f.path for f in model_files(bundled_path())]


def test_model_files_needs_a_config_json(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="no config.json"):
        model_files(tmp_path)


def test_run_spec_refuses_an_unknown_task():
    m = manifest()
    bad = ManifestRecord(**{**m.dict(), "task": TaskSpec(name="no-such-task", config_json="{}")})
    with pytest.raises(ManifestError, match="cannot build"):
        run_spec(bad, OWNER)


def test_run_spec_imports_a_plugin_task_only_from_a_module_the_user_allowed(tmp_path, monkeypatch):
    name = f"hivegrpo_test_manifest_plugin_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "imported.txt"
    source = "from peer.tasks.addition import AdditionTask\nopen({!r}, 'a').write('imported')\nmake = AdditionTask\n"
    (tmp_path / f"{name}.py").write_text(source.format(str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    m = manifest()
    named = ManifestRecord(**{**m.dict(), "task": TaskSpec(name=f"{name}:make", config_json="{}")})
    for allowed in (frozenset(), frozenset({"os", f"{name}.tasks"})):
        with pytest.raises(ManifestError, match=f"module '{name}' this peer has not allowed") as info:
            run_spec(named, OWNER, allowed_modules=allowed)
        assert f"--allow-task {name}" in str(info.value) and "never runs code" in str(info.value)
    assert not marker.exists() and name not in sys.modules, "a manifest made this peer import a module"
    system = ManifestRecord(**{**m.dict(), "task": TaskSpec(name="os:system", config_json='{"command": "true"}')})
    with pytest.raises(ManifestError, match="'os:system', whose module 'os'"):
        run_spec(system, OWNER)
    spec = run_spec(named, OWNER, allowed_modules=frozenset({name}))
    assert marker.read_text() == "imported" and spec.task.name == f"{name}:make"
    assert spec.example(OWNER, 3) == run_spec(m, OWNER).example(OWNER, 3), "the plug-in is addition"
    with_plugin = build_manifest(RunSettings(run_id="r", task=f"{name}:make"), bundled_path(), "0" * 64, PEER_ID)
    assert with_plugin.task.name == f"{name}:make", "the host allows the plug-in it was told to run"
    sys.modules.pop(name)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda g: {**g, "bogus": {}}, "unknown GRPO section"),
        (lambda g: {**g, "groups_per_version": 0}, "groups_per_version"),
        (lambda g: {**g, "groups_per_version": True}, "groups_per_version"),
        (lambda g: {**g, "sampling": {**g["sampling"], "group_size": 65}}, "exceed the protocol"),
        (lambda g: {**g, "loss": {"no_such_knob": 1}}, "no_such_knob"),
    ],
    ids=["section", "groups-0", "groups-bool", "group-size", "loss-field"],
)
def test_run_spec_refuses_bad_hyperparameters(change, message):
    m = manifest()
    bad = m.copy(update={"grpo_json": json.dumps(change(m.grpo()))})
    with pytest.raises(ManifestError, match=message):
        run_spec(bad, OWNER)


def test_tau_max_must_fit_the_bucket_ring():
    assert run_spec(manifest(staleness=StalenessConfig(tau_max=61)), OWNER).staleness.tau_max == 61
    with pytest.raises(ManifestError, match="bucket ring"):
        manifest(staleness=StalenessConfig(tau_max=62))


# ---------------------------------------------------------------------------------------------------- base model


def test_resolve_base_links_the_bundled_files_from_the_cache(tmp_path):
    spec = manifest().model
    cache = BlobCache(tmp_path / "blobs")
    folder = resolve_base(spec, cache, tmp_path / "models")
    assert folder.parent == tmp_path / "models"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f.path for f in spec.files)
    for f in spec.files:
        assert sha256_file(folder / f.path) == (f.sha256, f.size)
        assert (folder / f.path).is_symlink()
        assert (folder / f.path).resolve() == cache.path(f.sha256).resolve()
        assert cache.has(f.sha256)
    assert resolve_base(spec, cache, tmp_path / "models") == folder  # again: the same folder
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]


def test_resolve_base_refuses_a_file_that_hashes_wrong(tmp_path):
    wrong = "f" * 64
    spec = ModelSpec(
        name="bundled",
        revision=None,
        quantization="none",
        files=[ModelFile(path="config.json", sha256=wrong, size=(bundled_path() / "config.json").stat().st_size)],
    )
    cache = BlobCache(tmp_path / "blobs")
    with pytest.raises(ModelSourceError) as error:
        resolve_base(spec, cache, tmp_path / "models", fetch=None)
    message = str(error.value)
    assert "'config.json'" in message and str(bundled_path() / "config.json") in message
    assert "hashes to" in message
    assert not cache.has(wrong)
    assert cache.list() == []
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []


def _hub_cache(root, repo_id: str, source) -> Path:
    """A Hugging Face cache holding ``source``'s files as the hub's client lays them out (blobs, a snapshot of
    links, refs/main)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            blob = repo / "blobs" / sha256_file(path)[0]
            blob.write_bytes(path.read_bytes())
            (snapshot / path.name).symlink_to(blob)
    return snapshot


def test_resolve_base_uses_a_hub_model_already_in_the_hugging_face_cache(tmp_path, monkeypatch):
    """A hub model a user downloaded before is taken from the Hugging Face cache once each file hashes to the
    manifest's sha256 (no P2P, no hub); a file there that hashes otherwise is not used, and the error says so."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    snapshot = _hub_cache(tmp_path / "hf", "someone/tiny-llama", bundled_path())
    spec = ModelSpec(name="someone/tiny-llama", revision=None, quantization="nf4", files=model_files(bundled_path()))

    def no_fetch(sha256, size, progress):
        raise AssertionError("a file in the Hugging Face cache was fetched over P2P")

    cache = BlobCache(tmp_path / "blobs")
    folder = resolve_base(spec, cache, tmp_path / "models", fetch=no_fetch)
    for f in spec.files:
        assert sha256_file(folder / f.path) == (f.sha256, f.size)
        assert cache.path(f.sha256).resolve() == (snapshot / f.path).resolve()  # adopted where it is, not copied

    (snapshot / "config.json").unlink()  # now the cached config.json is another file
    (snapshot / "config.json").write_text("{}")
    config = next(f for f in spec.files if f.path == "config.json")
    with pytest.raises(ModelSourceError, match=r"'config.json'.*hashes to") as error:
        resolve_base(spec, BlobCache(tmp_path / "blobs2"), tmp_path / "models2", fetch=None)
    assert str(snapshot / "config.json") in str(error.value) and config.sha256[:12] in str(error.value)


# ---------------------------------------------------------------------------------------------------- verification


@pytest.fixture(scope="module")
def rollout_setup():
    from peer.model.adapter import attach_lora
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.loading import load_base

    spec = run_spec(manifest(), OWNER)
    base = load_base(ModelConfig(device="cpu", quantization="none"))
    torch.manual_seed(0)
    model = attach_lora(base.model, LoRAConfig())
    seq0 = 40
    batch, rewards = sample_scored(model, base.tokenizer, spec, OWNER, range(seq0, seq0 + 2), seed=1)
    groups = build_groups(
        batch, rewards, range(seq0, seq0 + 2), spec, version=0, sha=SHA, owner=OWNER, producer=PEER_ID
    )
    return SimpleNamespace(
        spec=spec,
        model=model,
        tokenizer=base.tokenizer,
        groups=groups,
        examples=[spec.example(OWNER, seq) for seq in range(seq0, seq0 + 2)],
    )


def known(v):
    return SHA if v == 0 else None


def test_build_groups_records_what_was_sampled(rollout_setup):
    r = rollout_setup
    assert [g.seq for g in r.groups] == [40, 41] and [g.task_index for g in r.groups] == [40, 41]
    for g, example in zip(r.groups, r.examples, strict=True):
        assert (g.version, g.adapter_sha256, g.producer) == (0, SHA, PEER_ID)
        assert g.task_seed == prompt_seed(r.spec.seed, OWNER)
        assert g.prompt_tokens() == r.tokenizer(example.prompt)["input_ids"]
        assert len(g.completions) == len(g.rewards) == r.spec.sampling.group_size
        for c in g.completions:
            assert 1 <= len(c.tokens()) <= r.spec.sampling.max_new_tokens
            assert all(lp <= 0.0 for lp in c.behaviour_logprobs())
        assert time.time() - g.created < 600


def test_honest_groups_pass(rollout_setup):
    r = rollout_setup
    for g in r.groups:
        assert check_group(g, OWNER, r.spec, r.tokenizer, known) is None


def _refusal(r, g, owner=OWNER, known_adapter=known) -> Refused:
    found = check_group(g, owner, r.spec, r.tokenizer, known_adapter)
    assert isinstance(found, Refused) and found.reason in REASONS
    assert found.startswith(f"{found.reason}: ")
    return found


def test_a_false_reward_claim_is_refused(rollout_setup):
    r = rollout_setup
    g = r.groups[0]
    rewards = list(g.rewards)
    rewards[3] = 1.0 - rewards[3]
    found = _refusal(r, changed(g, rewards=rewards))
    assert found.reason == "reward" and "completion 3" in found


def test_someone_elses_prompt_is_refused(rollout_setup):
    r = rollout_setup
    assert _refusal(r, r.groups[0], owner=OTHER).reason == "prompt"
    # the right seed and index but other prompt tokens
    g = r.groups[0]
    swapped = changed(g, prompt_ids=r.groups[1].prompt_ids)
    assert _refusal(r, swapped).reason == "prompt"
    # another seq's example under this seq
    moved = changed(g, task_index=g.seq + 1)
    assert _refusal(r, moved).reason == "prompt"


def test_an_unknown_adapter_version_is_refused(rollout_setup):
    r = rollout_setup
    g = r.groups[0]
    assert _refusal(r, g, known_adapter=lambda v: None).reason == "version"
    assert _refusal(r, g, known_adapter=lambda v: SHA_X).reason == "lineage"  # known version, other bytes


def test_the_wrong_group_size_is_refused(rollout_setup):
    r = rollout_setup
    g = r.groups[0]
    fewer = changed(g, completions=g.completions[:-1], rewards=g.rewards[:-1])
    found = _refusal(r, fewer)
    assert found.reason == "shape" and f"{r.spec.sampling.group_size - 1} completions" in found


def test_long_completions_and_foreign_tokens_are_refused(rollout_setup):
    r = rollout_setup
    g = r.groups[0]
    n = r.spec.sampling.max_new_tokens + 1
    long = [Completion.of([5] * n, [-0.1] * n)] + list(g.completions[1:])
    assert _refusal(r, changed(g, completions=long)).reason == "shape"
    foreign = [Completion.of([len(r.tokenizer)], [-0.1])] + list(g.completions[1:])
    assert _refusal(r, changed(g, completions=foreign)).reason == "vocabulary"


def test_behaviour_logprobs_are_spot_checked(rollout_setup):
    r = rollout_setup
    for g in r.groups:
        assert check_logprobs(r.model, g, r.spec, tolerance=1e-3) is None
    g = r.groups[1]
    forged = [
        Completion(token_ids=c.token_ids, logprobs=encode_floats([-0.01] * len(c.tokens()))) for c in g.completions
    ]
    found = check_logprobs(r.model, changed(g, completions=forged), r.spec, tolerance=1e-3)
    assert isinstance(found, Refused) and found.reason == "logprobs"


def test_the_heartbeat_rate_counts_what_the_span_covers():
    # batches of 64 completions ending at t = 10, 11, 12: two batches in the 2 s after the first one ended
    assert recent_rate([(10.0, 64), (11.0, 64), (12.0, 64)], elapsed=0.5) == 64.0
    assert recent_rate([(10.0, 64), (14.0, 64)], elapsed=0.5) == 16.0, "the 3.5 s wait counts"
    assert recent_rate([(10.0, 64)], elapsed=0.5) == 128.0, "one batch: its own rate"


def test_backpressure_pauses_for_a_new_version_but_not_forever():

    from peer.roles.rollout.peer import RolloutPeer

    class Follower:  # no new version ever comes (a learner whose updates had no signal)
        def wait(self, timeout):
            time.sleep(0.01)

        def take(self):
            return None

    peer = RolloutPeer.__new__(RolloutPeer)
    peer._stop, peer.follower, peer.stats = threading.Event(), Follower(), {"waited_s": 0.0}
    peer.session, peer.max_inflight, peer.MAX_PAUSE = SimpleNamespace(version=3), 32, 0.3
    peer.backlog = SimpleNamespace(version=-1, estimate=lambda version: 32)  # the bucket of v3 is full
    t0 = time.perf_counter()
    peer._wait_for_learners()
    assert 0.3 <= time.perf_counter() - t0 < 2.0 and peer.backlog.version == 3
    peer.backlog.estimate = lambda version: 31  # room in the bucket: no pause at all
    t0 = time.perf_counter()
    peer._wait_for_learners()
    assert time.perf_counter() - t0 < 0.1


def test_the_backlog_never_counts_fewer_than_this_peers_own_groups():
    class Store:  # the DHT holds 4 of this peer's 8 groups of v2 (the other 4 are still being scored and stored)
        def count(self, lo, hi):
            return 4

    backlog = Backlog(Store(), interval=3600.0)
    backlog.enqueued(2, 8)
    backlog.count_now(2)
    assert backlog.estimate(2) == 8, "the count taken mid-publication must not undercount this peer's groups"
    backlog._counted = (2, 20, 8)  # other peers' groups too: the count is above what this peer queued
    backlog.enqueued(2, 4)
    assert backlog.estimate(2) == 24
    assert backlog.estimate(3) == 0 and backlog.enqueued_in(0, 5) == 12
    backlog.stop()


def test_received_counts_the_bytes_of_every_transfer_attempt():
    from peer.run.adapters import Received

    r = Received()
    r(10, 30)
    r(30, 30)
    assert r.bytes == 30
    r.next_transfer()
    r(20, 30)  # a provider cut this one short; the fetch moves on to another provider, whose bytes start at 0
    r(5, 30)
    r(30, 30)
    assert r.bytes == 30 + 20 + 30


def test_bucket_entries_live_until_their_ring_slot_comes_round_within_bounds():
    from peer.protocol import BUCKET_RING
    from peer.roles.rollout.peer import BUCKET_EXPIRATION, MIN_BUCKET_EXPIRATION, bucket_expiration

    assert bucket_expiration(0.0) == BUCKET_EXPIRATION, "versions not yet measured: the longest"
    assert bucket_expiration(0.5) == MIN_BUCKET_EXPIRATION, "the demo's pace: a minute, for clocks apart"
    assert bucket_expiration(5.0) == (BUCKET_RING - 2) * 5.0 < BUCKET_RING * 5.0, "gone before the slot is reused"
    assert bucket_expiration(60.0) == BUCKET_EXPIRATION, "a real model's pace: at most ten minutes"


def test_the_publish_linger_is_a_tenth_of_the_time_between_versions_at_most_its_setting():
    from peer.roles.rollout.peer import LINGER_SHARE, publish_linger

    assert publish_linger(0.25, 0.0) == 0.25, "versions not yet measured: the setting"
    assert publish_linger(0.25, 0.4) == pytest.approx(LINGER_SHARE * 0.4), "the demo's pace: 0.04 s, not 0.25"
    assert publish_linger(0.25, 30.0) == 0.25, "a real model's pace: the setting"


def test_a_store_asks_a_callable_expiration_at_each_store():
    from peer.network.buckets import DHTBucketStore
    from tests.helpers.records import make_group

    stored, life = [], [60.0]
    swarm = SimpleNamespace(
        run_id="r",
        public_key=b"ssh-rsa A",
        peer_id="QmSelf",
        store_many=lambda items, what, **_: stored.extend(e for *_, e in items) or [True] * len(items),
    )
    store = DHTBucketStore(swarm, expiration=lambda: life[0])
    store.publish(make_group(version=2, seq=0))
    life[0] = 300.0
    store.publish(make_group(version=2, seq=1))
    now = time.time()
    assert now + 50 < stored[0] <= now + 60 and now + 290 < stored[1] <= now + 300
