"""Checking a rollout group against the run before anything learns from it. A peer's claims are never trusted.

:func:`check_group` answers, for a group read from a bucket and the key that signed it, either ``None`` (it is
what it says) or the *reason* it is refused, one short name from :data:`REASONS` plus a sentence. It checks:

* shape: G completions as the run says, each at most ``max_new_tokens`` long, every token id inside the
  tokenizer's vocabulary, the adapter version one the caller knows (with its sha256);
* the prompt: ``(task_seed, task_index)`` must be ``(prompt_seed(run_seed, owner), seq)``, and the prompt tokens
  must be exactly what the tokenizer makes of that example's prompt;
* the rewards: recomputed from the decoded completions and the regenerated example, they must equal the claims.

:func:`check_logprobs` recomputes the behaviour log-probs under a model holding the group's adapter — a spot check
a learner runs on a sample of groups, since it costs a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

from peer.protocol import GroupRecord
from peer.roles.run import RunSpec, prompt_seed

REASONS = (
    "shape",
    "vocabulary",
    "version",
    "lineage",
    "prompt",
    "reward",
    "logprobs",
    # a learner's intake (peer.roles.intake) adds these
    "schema",
    "replay",
    "unknown_version",
    "surplus",
)
REWARD_TOLERANCE = 1e-6


class Refused(str):
    """A refusal: ``reason`` (one of :data:`REASONS`) and the sentence saying what was wrong."""

    reason: str

    def __new__(cls, reason: str, message: str) -> Refused:
        value = super().__new__(cls, f"{reason}: {message}")
        value.reason = reason
        return value


def check_group(
    group: GroupRecord,
    owner: bytes,
    spec: RunSpec,
    tokenizer,
    known_adapter: Callable[[int], str | None],
) -> Refused | None:
    """``None`` if ``group`` (signed by ``owner``) is honest as far as can be checked without a model."""
    s = spec.sampling
    if len(group.completions) != s.group_size:
        return Refused("shape", f"{len(group.completions)} completions, the run samples {s.group_size}")
    vocab = len(tokenizer)
    prompt = group.prompt_tokens()
    completions = [c.tokens() for c in group.completions]
    for tokens in completions:
        if len(tokens) > s.max_new_tokens:
            return Refused("shape", f"a completion of {len(tokens)} tokens, the run allows {s.max_new_tokens}")
    if any(t >= vocab for t in prompt) or any(t >= vocab for c in completions for t in c):
        return Refused("vocabulary", f"token ids outside the vocabulary of {vocab}")
    sha = known_adapter(group.version)
    if sha is None:
        return Refused("version", f"adapter version {group.version} is not one this reader knows")
    if sha != group.adapter_sha256:
        return Refused(  # made under another lineage's v (two learners leading at once): ignored, not banned
            "lineage", f"adapter v{group.version} is {sha[:12]}…, the group says {group.adapter_sha256[:12]}…"
        )
    expected_seed = prompt_seed(spec.seed, owner)
    if (group.task_seed, group.task_index) != (expected_seed, group.seq):
        return Refused(
            "prompt", f"example ({group.task_seed}, {group.task_index}) is not this peer's for seq {group.seq}"
        )
    example = spec.task.example(expected_seed, group.seq)
    if tokenizer(example.prompt)["input_ids"] != prompt:
        return Refused("prompt", "the prompt tokens are not the tokenized prompt of its example")
    for i, (tokens, claimed) in enumerate(zip(completions, group.rewards, strict=True)):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        reward = spec.task.reward(text, example)
        if abs(reward - claimed) > REWARD_TOLERANCE:
            return Refused("reward", f"completion {i} scores {reward:g}, the group claims {claimed:g}")
    return None


def pack_rows(groups: list[GroupRecord], pad_id: int, device):
    """Every completion of ``groups`` as one row in the layout of :func:`peer.grpo.completion_logprobs`: the prompt
    left-padded with ``pad_id`` (mask 0 there), the completion right-padded. Returns ``(prompt_ids, prompt_mask,
    completion_ids, completion_mask)``."""
    import torch

    prompts = [g.prompt_tokens() for g in groups for _ in g.completions]
    completions = [c.tokens() for g in groups for c in g.completions]
    P, C = max(len(p) for p in prompts), max(len(c) for c in completions)
    return (
        torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts], dtype=torch.long, device=device),
        torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device),
        torch.tensor([c + [pad_id] * (C - len(c)) for c in completions], dtype=torch.long, device=device),
        torch.tensor([[True] * len(c) + [False] * (C - len(c)) for c in completions], device=device),
    )


def check_logprobs(model, group: GroupRecord, spec: RunSpec, tolerance: float) -> Refused | None:
    """Recompute the behaviour log-probs of ``group`` under ``model`` (holding the group's adapter)."""
    return check_logprobs_many(model, [group], spec, tolerance)[0]


def check_logprobs_many(model, groups: list[GroupRecord], spec: RunSpec, tolerance: float) -> list[Refused | None]:
    """:func:`check_logprobs` for several groups of one adapter version in one forward pass.

    One pass matters on a quantized base: each forward dequantizes every layer whatever the batch, so on the
    bundled nf4 model one group alone cost about as much as four together.
    """
    import torch

    from peer.grpo import completion_logprobs

    prompt_ids, prompt_mask, ids, _ = pack_rows(groups, 0, next(model.parameters()).device)
    with torch.no_grad():
        recomputed = completion_logprobs(model, prompt_ids, prompt_mask, ids, spec.sampling.temperature).tolist()
    results: list[Refused | None] = []
    row = 0
    for g in groups:
        worst = 0.0
        for completion in g.completions:
            claimed = completion.behaviour_logprobs()
            worst = max([worst, *(abs(a - b) for a, b in zip(recomputed[row], claimed, strict=False))])
            row += 1
        if worst > tolerance:
            results.append(
                Refused("logprobs", f"behaviour log-probs differ from the recomputed ones by up to {worst:.3g}")
            )
        else:
            results.append(None)
    return results
