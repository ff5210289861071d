"""A valid record of every kind the protocol stores, each with keyword overrides for what a test varies.

Only :mod:`peer.protocol` is imported, so the processes in tests/procs build their groups here too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from peer.protocol.records import (
    AdapterRecord,
    BlobPointer,
    Completion,
    Credit,
    CreditRecord,
    GroupRecord,
    ManifestRecord,
    MetricsRecord,
    ModelFile,
    ModelSpec,
    PeerRecord,
    TaskSpec,
    encode_tokens,
)

SHA_A, SHA_B = "a" * 64, "0123456789abcdef" * 4
PEER_A, PEER_B = "QmPeerA", "12D3KooWPeerB"
PEER_ID = "12D3KooWQxzDHbPHdvWj5HXFfMVFtN1VbGNMW2GfRhDKVo2RFhdT"
"""A peer id of the length libp2p gives an Ed25519 key: the producer of every group unless a test names another."""


def adapter_sha(version: int) -> str:
    """A stand-in sha256 for adapter ``version``'s bytes: the hash a group of that version carries by default."""
    return hashlib.sha256(b"adapter v%d" % version).hexdigest()


def completion(n: int = 3, logprob: float = -0.5) -> Completion:
    """``n`` tokens ``1 .. n``, each with behaviour log-prob ``logprob``."""
    return Completion.of(list(range(1, n + 1)), [logprob] * n)


def make_group(
    *,
    version: int = 5,
    seq: int = 2,
    producer: str = PEER_ID,
    adapter_sha256: str | None = None,
    task_seed: int = 123,
    task_index: int | None = None,
    prompt: Sequence[int] = (4, 5, 6),
    completions: Sequence[Completion | dict | Sequence[int]] | None = None,
    logprob: float = -0.5,
    rewards: Sequence[float] | None = None,
    created: float = 1700000000.5,
) -> GroupRecord:
    """A valid group: by default two completions of different lengths and log-probs, so that a codec that mixes
    them up shows.

    ``prompt`` is a token list; each of ``completions`` a :class:`Completion`, its dict, or a token list (every
    token with log-prob ``logprob``); ``rewards`` default to 0, 1, 0, 1, ... (the group has signal);
    ``adapter_sha256`` to :func:`adapter_sha` of ``version``; ``task_index`` to ``seq`` (a rollout peer's
    example ``seq`` of its own prompt stream).
    """
    if completions is None:
        made = [completion(3, -0.5), completion(2, -1.25)]
    else:
        made = [
            c if isinstance(c, (Completion, dict)) else Completion.of(list(c), [logprob] * len(c)) for c in completions
        ]
    return GroupRecord(
        version=version,
        adapter_sha256=adapter_sha(version) if adapter_sha256 is None else adapter_sha256,
        producer=producer,
        seq=seq,
        task_seed=task_seed,
        task_index=seq if task_index is None else task_index,
        prompt_ids=encode_tokens(list(prompt)),
        completions=made,
        rewards=[float(i % 2) for i in range(len(made))] if rewards is None else list(rewards),
        created=created,
    )


def changed(group: GroupRecord, **fields) -> GroupRecord:
    """A copy of ``group`` with ``fields`` replaced, validated again (a valid record: only a learner's checks can
    tell it is a lie)."""
    return GroupRecord(**{**group.dict(), **fields})


def make_manifest(**fields) -> ManifestRecord:
    values = dict(
        run_id="run-1",
        created=1700000000.0,
        access="private",
        seed=0,
        model=ModelSpec(
            name="bundled",
            revision=None,
            quantization="nf4",
            files=[
                ModelFile(path="model.safetensors", sha256=SHA_A, size=3_000_000),
                ModelFile(path="tok/tokenizer.json", sha256=SHA_B, size=0),
            ],
        ),
        task=TaskSpec(name="addition", config_json=json.dumps({"digits": 3})),
        grpo_json=json.dumps({"sampling": {"group_size": 8}, "staleness": {"tau_max": 4}}),
        lora_json=json.dumps({"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
        adapter0_sha256=SHA_B,
        coordinator=PEER_B,
    )
    values.update(fields)
    return ManifestRecord(**values)


def make_heartbeat(**fields) -> PeerRecord:
    values = dict(
        peer_id=PEER_A,
        role="rollout",
        adapter_version=-1,
        throughput=0.0,
        hardware="cpu x2",
        reachable=False,
        maddrs=["/ip4/127.0.0.1/tcp/4001/p2p/QmPeerA"],
        started=100.0,
        last_seen=130.5,
        state="running",
        stats={"groups_per_s": 0.25, "tokens": 1000.0},
    )
    values.update(fields)
    return PeerRecord(**values)


def make_adapter(**fields) -> AdapterRecord:
    values = dict(
        version=3,
        sha256=SHA_A,
        parent_sha256=SHA_B,
        ancestors=[SHA_B],
        size=29680,
        providers=[PEER_A, PEER_B],
        created=5.0,
        learner=PEER_A,
    )
    values.update(fields)
    return AdapterRecord(**values)


def make_pointer(**fields) -> BlobPointer:
    values = dict(sha256=SHA_A, size=200_000, providers=[PEER_A], kind="group")
    values.update(fields)
    return BlobPointer(**values)


def make_metrics(**fields) -> MetricsRecord:
    values = dict(
        learner=PEER_A,
        version=12,
        groups_accepted=40,
        groups_dropped_stale=3,
        groups_rejected={"bad_reward": 1, "duplicate": 2},
        staleness_mean=1.5,
        staleness_max=4,
        reward_mean=0.42,
        exact_match=None,
        step_seconds=2.5,
        banned=[],
        created=9.0,
    )
    values.update(fields)
    return MetricsRecord(**values)


def make_credit(**fields) -> CreditRecord:
    values = dict(
        learner=PEER_A,
        version=12,
        groups_used=50,
        contributors_known=3,
        contributors={
            "0123456789abcdef": Credit(
                name="alice", used=40, refused=3, reasons={"surplus": 3}, stale=2, no_signal=9, since=5.0
            ),
            "fedcba9876543210": Credit(name=None, used=10, refused=0, reasons={}, stale=0, no_signal=0, since=6.0),
        },
        created=9.0,
    )
    values.update(fields)
    return CreditRecord(**values)
