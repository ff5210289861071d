"""Poisoned-but-valid groups: the right answer plus a payload the reward never reads, log-probs honestly claimed.

What an attacker who wants a payload reinforced sends (docs/reliability.md, "Poisoning"): it samples its prompts from
the current adapter, then in every completion that is right writes the payload after the answer (here ``<unk>``, a
special token the decoded text drops, so the reward still sees the right answer); where no completion is right it
writes one, and where all are right it makes one wrong, so that the group carries signal. Its behaviour log-probs
are the adapter's own for the written text (teacher-forced): the one claim no spot check refuses, and the one that
leaves the clipped ratio at 1 (claiming more shrinks its own gradient, claiming less is clipped).

Used by ``tests.benchmarks.poisoning`` (in one process) and by ``tests/procs/liar_rollout.py poison`` (a real
``hivegrpo join`` whose sampler writes them).
"""

from __future__ import annotations


def wrong_answer(reference: str) -> str:
    """A wrong answer of the reference's width (its last digits plus one)."""
    return f"{(int(reference) + 1) % 10 ** len(reference):0{len(reference)}d}"


def poisoned_rows(
    rows: list[list[int]], right: list[bool], answer: list[int], wrong: list[int], payload: int, eos: int, most: int
) -> list[list[int]]:
    """The completions ``rows`` of one group (``right[i]``: row i's answer is right) as the attacker sends them:
    ``answer + [payload, eos]`` in place of every right one, one written where none is right, one made ``wrong``
    where all are; each at most ``most`` tokens."""
    written = [*answer, payload, eos][:most]
    out = [written if r else list(t) for t, r in zip(rows, right, strict=True)]
    if not any(right):
        out[0] = written
    if all(right):
        out[-1] = [*wrong, eos][:most]
    return out


def teacher_forced(model, prompt_ids, prompt_mask, rows: list[list[int]], temperature: float, pad_id: int):
    """``(completion_ids, completion_mask, logprobs)`` of ``rows`` after their prompts (one row each, left-padded
    tensors as sampling gives them): the adapter's own log-probs of the written tokens, 0 where masked."""
    import torch

    from peer.grpo import completion_logprobs

    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logprobs = completion_logprobs(model, prompt_ids, prompt_mask, ids, temperature)
    return ids, mask, torch.where(mask, logprobs, torch.zeros_like(logprobs))


__all__ = ["poisoned_rows", "teacher_forced", "wrong_answer"]
