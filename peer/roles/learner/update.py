"""One update of the adapter from verified groups: the batch, its gradient in shares, and the AdamW step.

A learner alone runs :func:`learn_step` (= :func:`share_gradient` over the whole batch + :func:`apply_gradient`).
A team of learners (:mod:`peer.roles.learner.team.lead`) splits the update's groups into shares, one per learner: each
computes :func:`share_gradient` of its share's token-mean loss, and the leader combines them weighted by token count
(:func:`combine`) — the gradient of the token-mean loss over all the groups, the same update one learner would make
— then clips and steps (:func:`apply_gradient`). The clipped gradient goes to every learner, whose identical AdamW
then makes the identical adapter. A share's weight is :func:`signal_tokens` of its groups, which the leader computes
itself from the groups it assigned (a helper's own count is never trusted).

What crosses the network is tensors as safetensors and numbers as msgpack, never pickle: a gradient
(:func:`tensors_to_bytes`), and the AdamW state a learner joining the team takes (:func:`optimizer_state_to_wire`:
per-parameter step counts and moments; the hyper-parameters are never sent, each learner keeps its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from peer.grpo import (
    clipped_policy_loss,
    completion_logits,
    completion_logprobs,
    group_advantages,
    improbable_tokens,
    staleness_weight,
    token_logprobs,
)
from peer.model.adapter import lora_parameters
from peer.roles.learner.verify import pack_rows


@dataclass
class Batch:
    """The tensors of one update, rows prompt-major (row = group * G + completion)."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded
    completion_mask: torch.Tensor  # [B, C] bool
    behaviour: torch.Tensor  # [B, C] float32
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B] staleness weights
    rewards: torch.Tensor  # [groups, G]


@dataclass
class Share:
    """The gradient of one share's token-mean loss (``grads`` in ``lora_parameters`` order) and its statistics."""

    grads: list[torch.Tensor]
    tokens: int  # completion tokens of the rows with signal: the share's weight in :func:`combine`
    stats: dict  # loss, clip_fraction, ratio_mean (token means), ratio_max, rows, improbable (tokens left out)
    evidence: tuple[torch.Tensor, torch.Tensor] | None = None
    """Per row of the batch (0 where a row has no signal): its completion tokens below the run's ``token_floor``, for
    the policy and in the sampler's own claim, and how many honest sampling would give there
    (:func:`peer.grpo.logprobs.improbable_tokens`); None when the floor is off. Kept by the learner that computed the
    share: it never crosses the network."""


def batch_tensors(accepted: list, version: int, spec, pad_id: int, device) -> Batch:
    """Pack verified groups (``Accepted``; their staleness against ``version``) into the loss's layout."""
    behaviour, weights, rewards = [], [], []
    for a in accepted:
        g = a.group
        w = staleness_weight(version - g.version, spec.staleness)
        rewards.append(list(g.rewards))
        for c in g.completions:
            behaviour.append(c.behaviour_logprobs())
            weights.append(w)
    prompt_ids, prompt_mask, completion_ids, completion_mask = pack_rows([a.group for a in accepted], pad_id, device)
    C = completion_ids.shape[1]
    behaviour_t = torch.tensor([b + [0.0] * (C - len(b)) for b in behaviour], dtype=torch.float32)
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    advantages = group_advantages(rewards_t, spec.loss.adv_eps).flatten()
    return Batch(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        behaviour_t.to(device),
        advantages.to(device),
        torch.tensor(weights, dtype=torch.float32, device=device),
        rewards_t,
    )


def signal_tokens(batch: Batch) -> int:
    """Completion tokens of the rows that carry signal (a nonzero advantage): the share's weight in :func:`combine`."""
    return int(batch.completion_mask[batch.advantages.ne(0)].sum())


def row_lengths(batch: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Real prompt and completion tokens of ``rows`` (a prompt is left-padded, a completion's mask is a prefix)."""
    return batch.prompt_mask[rows].sum(1), batch.completion_mask[rows].sum(1)


def micro_batches(batch: Batch, rows: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    """``rows`` split into micro-batches whose padded size (rows x (longest prompt + longest completion)) is at most
    ``tokens``; a row longer than that alone makes one. Rows are taken longest first, so little is padding."""
    prompt, completion = row_lengths(batch, rows)
    order = torch.argsort(prompt + completion, descending=True, stable=True).tolist()
    parts: list[list[int]] = []
    width_p = width_c = 0
    for i in order:
        p, c = int(prompt[i]), int(completion[i])
        wp, wc = max(width_p, p), max(width_c, c)
        if parts and (len(parts[-1]) + 1) * (wp + wc) <= tokens:
            parts[-1].append(i)
            width_p, width_c = wp, wc
        else:
            parts.append([i])
            width_p, width_c = p, c
    return [rows[torch.tensor(sorted(part))] for part in parts]


def _trimmed(batch: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' prompt ids and mask, completion ids and mask, without the columns that are padding in all of them
    (positions count real tokens only, and nothing attends to a padded column, so the log-probs stay the same)."""
    prompt_mask, completion_mask = batch.prompt_mask[rows], batch.completion_mask[rows]
    first = int(prompt_mask.any(0).long().argmax())  # left padding: the first column any row uses
    last = max(1, int(completion_mask.any(0).sum()))  # right padding: the completion's columns any row uses
    return (
        batch.prompt_ids[rows, first:],
        prompt_mask[:, first:],
        batch.completion_ids[rows, :last],
        completion_mask[:, :last],
    )


def share_gradient(
    model, batch: Batch, spec, micro_batch_tokens: int | None = None, share_prompts: bool = True
) -> Share | None:
    """The clipped loss's gradient over the rows of ``batch`` that carry signal; None when no row does.

    ``micro_batch_tokens`` bounds the tokens of one forward/backward (:func:`micro_batches`; None: all rows at
    once). The loss is a token-mean over the rows, so micro-batch ``m``'s own token-mean loss, weighted by its share
    ``n_m / n`` of the completion tokens, sums to the whole batch's loss — policy and KL terms alike — and the
    accumulated gradient is the whole batch's (to float rounding). The statistics combine the same way (token-
    weighted means; the ratio's max over all).

    A group's rows sit side by side (and a micro-batch keeps their order), so each group's prompt runs forward once
    and only its completions run per row (``completion_logprobs(..., share_prompts=True)``): the same loss and
    gradient to float rounding. ``share_prompts=False`` runs every row's own forward (what
    ``python -m tests.benchmarks.update`` compares with).
    """
    rows = batch.advantages.ne(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    params = lora_parameters(model)
    T = spec.sampling.temperature
    if micro_batch_tokens is None:
        parts = [(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows], rows)]
    else:
        parts = [(*_trimmed(batch, part)[:3], part) for part in micro_batches(batch, rows, micro_batch_tokens)]
    floor = spec.loss.token_floor
    observed = expected = None
    left_out = 0  # tokens below the floor, left out of the loss
    if floor > 0:
        observed = torch.zeros(batch.advantages.shape[0], device=batch.advantages.device)
        expected = torch.zeros_like(observed)
    found = []  # (tokens, stats) of each micro-batch
    for p in params:
        p.grad = None
    model.train()
    try:
        for prompt_ids, prompt_mask, completion_ids, part in parts:
            width = completion_ids.shape[1]
            mask = batch.completion_mask[part, :width]
            logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, share_prompts=share_prompts)
            logprobs = token_logprobs(logits, completion_ids, T)
            if floor > 0:  # tokens the policy would hardly write teach nothing, and count as evidence of writing
                rare, mass = improbable_tokens(logits, completion_ids, T, math.log(floor))
                rare &= mask
                # evidence only where the sampler's own claim was improbable too: a token the policy has turned
                # against since the group was sampled (two versions took one from -0.16 to -7.45 in the demo) is
                # drift, and the same token in all of a group's completions; a writer's honest claim of its
                # payload is improbable (claiming more makes its ratio, and so its gradient, vanish)
                written = rare & (batch.behaviour[part, :width] < math.log(floor))
                observed[part] = written.sum(1).to(observed.dtype)
                expected[part] = torch.where(mask, mass, torch.zeros_like(mass)).sum(1)
                left_out += int(rare.sum())
                mask = mask & ~rare
            del logits
            ref = None
            if spec.loss.kl_beta > 0:
                with torch.no_grad(), model.disable_adapter():
                    ref = completion_logprobs(
                        model, prompt_ids, prompt_mask, completion_ids, T, share_prompts=share_prompts
                    )
            loss, stats = clipped_policy_loss(
                logprobs,
                batch.behaviour[part, :width],
                batch.advantages[part],
                mask,
                batch.weights[part],
                spec.loss,
                ref,
            )
            if len(parts) > 1:  # a sum over the micro-batch's tokens; divided by all the parts' tokens below
                loss = loss * stats.tokens
            loss.backward()
            found.append((stats.tokens, stats))
            del logprobs, ref, loss
    finally:
        model.eval()
    total = max(1, sum(n for n, _ in found))  # the tokens learned from (the improbable ones left out)
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    if len(parts) > 1:
        grads = [g / total for g in grads]
    for p in params:
        p.grad = None
    if len(found) == 1:
        stats = found[0][1]
        summary = {"loss": stats.loss, "clip_fraction": stats.clip_fraction, "ratio_mean": stats.ratio_mean}
    else:
        summary = {
            name: sum(getattr(st, name) * n for n, st in found) / total
            for name in ("loss", "clip_fraction", "ratio_mean")
        }
        if not any(n for n, _ in found):
            summary["ratio_mean"] = 1.0
    summary["ratio_max"] = max(st.ratio_max for _, st in found)
    summary["improbable"] = left_out
    evidence = (observed, expected) if observed is not None else None
    return Share(grads, signal_tokens(batch), {**summary, "rows": int(rows.numel())}, evidence)


class MicroBatcher:
    """A learner's gradient computation: micro-batches of at most ``tokens`` tokens (None: the whole batch at once),
    and on running out of memory the same step redone with half the tokens per micro-batch, kept from then on."""

    ADVICE = (
        "one row per micro-batch does not fit; give the learner more memory, add --gradient-checkpointing, or hold "
        "the base smaller (--quantization nf4)"
    )

    def __init__(self, tokens: int | None = None):
        if tokens is not None and tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {tokens}")
        self.tokens = tokens

    def share_gradient(self, model, batch: Batch, spec) -> Share | None:
        from peer.model.memory import retry_halving

        rows = batch.advantages.ne(0).nonzero().flatten()
        if rows.numel() == 0:
            return None
        prompt, completion = row_lengths(batch, rows)
        whole = int(rows.numel()) * int(prompt.max() + completion.max())
        longest = int((prompt + completion).max())  # at or below this, every micro-batch is one row
        start = whole if self.tokens is None else min(self.tokens, whole)

        def attempt(tokens: int) -> Share | None:
            split = None if tokens >= whole and self.tokens is None else tokens
            return share_gradient(model, batch, spec, split)

        share, used = retry_halving(attempt, start, floor=longest, what="micro-batch tokens", advice=self.ADVICE)
        if used < start:
            self.tokens = used
        return share


def enable_gradient_checkpointing(model) -> None:
    """Recompute each layer's activations during backward instead of keeping them (less memory, ~30% more time;
    the same gradient). Non-reentrant checkpointing, and inputs that require grad so that a frozen base under LoRA
    still has a graph to recompute through (what peft's ``prepare_model_for_kbit_training`` does)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.25; the old name warns
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def combine(shares: list[Share]) -> Share | None:
    """The token-weighted mean of the shares' gradients and statistics (None when no share has signal)."""
    shares = [s for s in shares if s is not None and s.tokens > 0]
    if not shares:
        return None
    if len(shares) == 1:
        return shares[0]
    total = sum(s.tokens for s in shares)
    grads = [sum(s.grads[i] * (s.tokens / total) for s in shares) for i in range(len(shares[0].grads))]
    stats = {
        name: sum(float(s.stats[name]) * s.tokens for s in shares) / total
        for name in ("loss", "clip_fraction", "ratio_mean")
    }
    stats["ratio_max"] = max(float(s.stats["ratio_max"]) for s in shares)
    stats["rows"] = sum(int(s.stats["rows"]) for s in shares)
    stats["improbable"] = sum(int(s.stats.get("improbable", 0)) for s in shares)
    return Share(grads, total, stats)


def apply_gradient(model, optimizer, grads: list[torch.Tensor], max_grad_norm: float | None) -> float:
    """Set the LoRA gradients to ``grads``, clip them to ``max_grad_norm`` (None: as they are, already clipped) and
    take one optimizer step; returns the norm before clipping. ``grads`` are left holding what was applied."""
    params = lora_parameters(model)
    for p, g in zip(params, grads, strict=True):
        if g.shape != p.shape:
            raise ValueError(f"a gradient of shape {list(g.shape)} for a parameter of shape {list(p.shape)}")
        p.grad = g.to(p.device, p.dtype)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else float("inf"))
    optimizer.step()
    for g, p in zip(grads, params, strict=True):
        g.copy_(p.grad)
        p.grad = None
    return float(norm)


def learn_step(
    model, batch: Batch, spec, optimizer, max_grad_norm: float, micro: MicroBatcher | None = None
) -> dict | None:
    """One clipped-loss AdamW step over the rows that carry signal; None when no row does (nothing to learn).
    ``micro`` splits the batch into micro-batches (the same update) and backs off when memory runs out."""
    share = (micro or MicroBatcher()).share_gradient(model, batch, spec)
    if share is None:
        return None
    grad_norm = apply_gradient(model, optimizer, share.grads, max_grad_norm)
    return {**share.stats, "grad_norm": grad_norm}


def tensors_to_bytes(tensors: list[torch.Tensor]) -> bytes:
    """Gradients (or any list of tensors) as safetensors bytes, named by position."""
    return st_save({str(i): t.detach().contiguous().cpu() for i, t in enumerate(tensors)})


def tensors_from_bytes(data: bytes, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`tensors_to_bytes`, checked against ``like`` (count, shapes, finite values)."""
    try:
        loaded = st_load(data)
    except Exception as e:  # safetensors raises its own error types on garbage
        raise ValueError(f"unreadable tensors: {e}") from None
    if sorted(loaded) != sorted(str(i) for i in range(len(like))):
        raise ValueError(f"{len(loaded)} tensors where {len(like)} were expected")
    out = []
    for i, ref in enumerate(like):
        t = loaded[str(i)]
        if t.shape != ref.shape or t.dtype != torch.float32 or not torch.isfinite(t).all():
            raise ValueError(f"tensor {i}: {list(t.shape)} {t.dtype}, expected finite {list(ref.shape)} float32")
        out.append(t.to(ref.device))
    return out


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter tensors (amsgrad adds max_exp_avg_sq)


def _moments(optimizer) -> tuple[str, ...]:
    amsgrad = any(group.get("amsgrad") for group in optimizer.param_groups)
    return MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())


def _parameters(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]  # state_dict()'s numbering


def optimizer_state_to_wire(optimizer) -> dict:
    """AdamW's per-parameter state as ``{"steps": [int, ...], "tensors": safetensors bytes}``: parameter ``i``'s step
    count (0: no state yet) and its moments as tensors ``"{i}.exp_avg"``, ``"{i}.exp_avg_sq"``. The hyper-parameters
    (learning rate, betas, weight decay...) are not sent: the receiver keeps its own."""
    steps, tensors = [], {}
    for i, p in enumerate(_parameters(optimizer)):
        state = optimizer.state.get(p)
        if not state:
            steps.append(0)
            continue
        step = float(state["step"])
        if step < 1 or step != int(step):
            raise ValueError(f"parameter {i}'s AdamW step count is {step}")
        steps.append(int(step))
        tensors |= {f"{i}.{name}": state[name].detach().contiguous().cpu() for name in _moments(optimizer)}
    return {"steps": steps if any(steps) else [], "tensors": st_save(tensors)}


def optimizer_state_from_wire(optimizer, wire: dict) -> dict:
    """The state dict to load into ``optimizer`` (:meth:`torch.optim.Optimizer.load_state_dict`) from another
    learner's :func:`optimizer_state_to_wire`: its step counts and moments, checked against ``optimizer``'s
    parameters (names, shapes, dtypes, finite values, second moments non-negative), and ``optimizer``'s own
    hyper-parameters. ValueError on anything else."""
    params, moments = _parameters(optimizer), _moments(optimizer)
    steps = list(wire["steps"])
    if len(steps) not in (0, len(params)):
        raise ValueError(f"step counts for {len(steps)} parameters, this learner has {len(params)}")
    try:
        loaded = st_load(bytes(wire["tensors"]))
    except Exception as e:  # safetensors raises its own error types on garbage
        raise ValueError(f"unreadable AdamW moments: {e}") from None
    expected = {f"{i}.{name}" for i, step in enumerate(steps) if step > 0 for name in moments}
    if set(loaded) != expected:
        raise ValueError(f"{len(loaded)} AdamW moment tensors where {len(expected)} were expected")
    state = {}
    for i, step in enumerate(steps):
        if step == 0:
            continue
        entry = {"step": torch.tensor(float(step), dtype=torch.float32)}
        for name in moments:
            t, p = loaded[f"{i}.{name}"], params[i]
            if t.shape != p.shape or t.dtype != p.dtype or not torch.isfinite(t).all():
                raise ValueError(f"{i}.{name}: {list(t.shape)} {t.dtype}, expected finite {list(p.shape)} {p.dtype}")
            if name != "exp_avg" and bool((t < 0).any()):
                raise ValueError(f"{i}.{name}: a second moment below zero")
            entry[name] = t
        state[i] = entry
    own = optimizer.state_dict()
    return {"state": state, "param_groups": own["param_groups"]}


__all__ = [
    "MOMENTS",
    "Batch",
    "MicroBatcher",
    "Share",
    "apply_gradient",
    "batch_tensors",
    "combine",
    "enable_gradient_checkpointing",
    "learn_step",
    "micro_batches",
    "optimizer_state_from_wire",
    "optimizer_state_to_wire",
    "share_gradient",
    "signal_tokens",
    "tensors_from_bytes",
    "tensors_to_bytes",
]
