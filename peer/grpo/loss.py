"""The clipped policy loss of asynchronous GRPO.

What is kept from GRPO, and why:

* **Group-normalized advantages** (:mod:`peer.grpo.advantages`), one per completion, shared by its tokens.
* **A clipped ratio against the behaviour policy.** Groups are sampled by rollout peers with whatever adapter
  version they held, often a few versions older than the learner's. The policy gradient needs samples from the
  policy being trained, so each token is reweighted by ``ratio = pi(token) / mu(token)``, where ``mu`` is the
  behaviour log-prob recorded at sampling. The PPO clip bounds that correction: once the ratio has moved past
  ``1 + clip_eps_high`` in the direction the advantage pushes (or below ``1 - clip_eps_low`` for a negative
  advantage), the token's gradient is exactly zero, so a stale group cannot drag the policy further than the
  band allows. (Measured on the bundled task, docs/benchmarks.md "Forced staleness": uncorrected, exact match falls
  to 0.10 at 4 versions of lag; clipped, it holds 0.68 at 4 and 0.58 at 8.)
* **Token-mean over the whole batch**: ``sum(loss * mask) / sum(mask)``. Every token counts the same, so a long
  completion is not down-weighted per token as a per-sequence mean would do.
* **An optional KL to the base policy** with the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``
  (non-negative, unbiased, low variance), weighted by ``kl_beta``. Off by default.

Each sequence may carry a staleness weight (:mod:`peer.grpo.staleness`) that scales its surrogate.
Behaviour and reference log-probs are data: they are detached, no gradient ever flows into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.grpo.config import LossConfig


@dataclass(frozen=True)
class LossStats:
    """What one loss evaluation measured, as plain numbers for logs and status.

    The ratio statistics are over masked tokens, and 1.0 (the on-policy value) when there are none.
    """

    loss: float
    """The value returned, policy term plus KL term."""
    policy_loss: float
    """Token-mean of ``-surrogate * weight``."""
    kl: float
    """Token-mean k3 KL to the reference when ``ref_logprobs`` was given (even with ``kl_beta == 0``), else 0."""
    clip_fraction: float
    """Fraction of masked tokens whose ratio was clipped, i.e. whose policy gradient is zero."""
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    tokens: int
    """Masked (counted) tokens."""


def _check(name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}.")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped surrogate loss, token-mean over the batch, and its statistics.

    Shapes: ``logprobs``, ``behaviour_logprobs``, ``mask`` (bool) and ``ref_logprobs`` are [B, C] in the
    completion layout of :mod:`peer.grpo.logprobs`; ``advantages`` and ``weights`` (per-sequence staleness
    weights, all 1 when None) are [B]. Per token::

        ratio     = exp(logprobs - behaviour_logprobs)
        surrogate = min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        surrogate = max(surrogate, dual_clip * A)   where A < 0 (dual clip; dual_clip = 0: off)
        loss      = -surrogate * w  +  kl_beta * k3(logprobs, ref_logprobs)

    and the result is ``sum(loss * mask) / max(sum(mask), 1)``. Values at unmasked positions may be anything,
    NaN included: they are selected away, never multiplied by zero. ``ref_logprobs`` is required when
    ``kl_beta > 0``.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape [B, C], got {list(logprobs.shape)}.")
    batch, length = logprobs.shape
    _check("behaviour_logprobs", behaviour_logprobs, (batch, length))
    _check("mask", mask, (batch, length))
    _check("advantages", advantages, (batch,))
    _check("weights", weights, (batch,))
    _check("ref_logprobs", ref_logprobs, (batch, length))
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}.")
    if config.kl_beta > 0 and ref_logprobs is None:
        raise ValueError(f"kl_beta={config.kl_beta} needs ref_logprobs (log-probs under the base policy).")

    logprobs = logprobs.float()
    adv = advantages.detach().float().unsqueeze(1)
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs.detach().float(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    # min(r*A, clip(r)*A) picks the clipped branch exactly when r has left the band in A's direction; there the
    # clamp's gradient is zero. Written with where() so "clipped" is one definition for the loss and the stats.
    clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    surrogate = torch.where(clipped, ratio.clamp(low, high) * adv, ratio * adv)
    if config.dual_clip > 0:  # dual clip: for A < 0 the surrogate is at least dual_clip * A (no gradient there)
        dual = (adv < 0) & (ratio > config.dual_clip)
        surrogate = torch.where(dual, config.dual_clip * adv, surrogate)
        clipped = clipped | dual
    if weights is not None:
        surrogate = surrogate * weights.detach().float().unsqueeze(1)
    policy_tokens = -surrogate

    kl_tokens = None
    if ref_logprobs is not None:
        ref_minus = torch.where(mask, ref_logprobs.detach().float() - logprobs, torch.zeros_like(logprobs))
        kl_tokens = torch.exp(ref_minus) - ref_minus - 1.0

    count = mask.sum()
    denom = count.clamp(min=1).float()
    zero = torch.zeros_like(logprobs)
    policy_loss = torch.where(mask, policy_tokens, zero).sum() / denom
    loss = policy_loss
    kl = torch.zeros((), device=logprobs.device)
    if kl_tokens is not None:
        kl = torch.where(mask, kl_tokens, zero).sum() / denom
        if config.kl_beta > 0:
            loss = loss + config.kl_beta * kl

    with torch.no_grad():
        masked_ratio = ratio.detach()[mask]
        if masked_ratio.numel() == 0:
            masked_ratio = torch.ones(1, device=logprobs.device)
        values = torch.stack(
            [
                loss.detach(),
                policy_loss.detach(),
                kl.detach(),
                (clipped & mask).sum() / denom,
                masked_ratio.mean(),
                masked_ratio.min(),
                masked_ratio.max(),
                count.float(),
            ]
        ).tolist()
    stats = LossStats(
        loss=values[0],
        policy_loss=values[1],
        kl=values[2],
        clip_fraction=values[3],
        ratio_mean=values[4],
        ratio_min=values[5],
        ratio_max=values[6],
        tokens=int(values[7]),
    )
    return loss, stats
