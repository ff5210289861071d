"""A sampled batch as the records a rollout peer publishes: one :class:`~peer.protocol.GroupRecord` per prompt.

Apart from :mod:`peer.roles.rollout.peer` so that whatever builds groups (the rollout peer's publisher, the tests'
helpers, a GPU check on a machine without the swarm's network stack) imports neither hivemind nor a session.
"""

from __future__ import annotations

import time

from peer.model.sampling import Completions
from peer.protocol import Completion, GroupRecord, encode_tokens
from peer.run.spec import RunSpec, prompt_seed


def build_groups(
    batch: Completions,
    rewards: list[float],
    seqs: range,
    spec: RunSpec,
    *,
    version: int,
    sha: str,
    owner: bytes,
    producer: str,
) -> list[GroupRecord]:
    """One GroupRecord per prompt of a sampled batch (rows are prompt-major: row = p * G + g)."""
    G = spec.sampling.group_size
    ids, cmask, logps = batch.completion_ids.tolist(), batch.completion_mask.tolist(), batch.logprobs.tolist()
    groups, now, task_seed = [], time.time(), prompt_seed(spec.seed, owner)
    for p, seq in enumerate(seqs):
        row = p * G
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        completions = []
        for r in range(row, row + G):
            kept = [i for i, m in enumerate(cmask[r]) if m]
            completions.append(Completion.of([ids[r][i] for i in kept], [min(0.0, logps[r][i]) for i in kept]))
        groups.append(
            GroupRecord(
                version=version,
                adapter_sha256=sha,
                producer=producer,
                seq=seq,
                task_seed=task_seed,
                task_index=seq,
                prompt_ids=encode_tokens(prompt),
                completions=completions,
                rewards=[float(x) for x in rewards[row : row + G]],
                created=now,
            )
        )
    return groups


__all__ = ["build_groups"]
