"""Group-normalized advantages, the part of GRPO that replaces a learned value function.

GRPO samples G completions of the same prompt and scores each with a verifiable reward. The group's own mean
is the baseline, so no critic is trained: a completion is good if it beat its siblings. Dividing by the group's
standard deviation puts every prompt on the same scale, whether its rewards are 0/1 or spread over [0, 10].

The standard deviation is the *population* one (``correction=0``, i.e. ``unbiased=False``): the group is
normalized as it is, not used to estimate the spread of some larger population. The normalized advantages of a
group then have mean 0 and mean square 1 (up to ``eps``) whatever G is, so the loss scale does not change with
the group size; Bessel's correction would shrink them by ``sqrt((G - 1) / G)``, most for small groups.

A group whose rewards are all equal (every completion right, or every one wrong) says nothing about which
completion is better. Its advantages are exactly zero, not ``0 / eps`` rounding noise, and :func:`has_signal`
lets the learner skip such groups instead of spending tokens on a zero gradient.
"""

from __future__ import annotations

import torch


def _check_rewards(rewards: torch.Tensor) -> None:
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a tensor of shape [..., G], got {type(rewards).__name__}.")
    if rewards.dim() < 1 or rewards.shape[-1] < 1:
        raise ValueError(f"rewards must have shape [..., G] with G >= 1, got {tuple(rewards.shape)}.")


def has_signal(rewards: torch.Tensor) -> torch.Tensor:
    """Per group (last dim is G), whether its rewards are not all equal: shape ``rewards.shape[:-1]``, bool."""
    _check_rewards(rewards)
    return rewards.amax(dim=-1) > rewards.amin(dim=-1)


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` over the last dim (the G completions of one prompt); same shape as ``rewards``.

    Leading dims are independent groups. Integer or low-precision rewards are computed in float32 (float64 stays
    float64). Groups without signal get exact zeros. Non-finite rewards raise ValueError: one NaN would otherwise
    spread to its whole group and then to the update.
    """
    _check_rewards(rewards)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}.")
    r = rewards if rewards.dtype == torch.float64 else rewards.to(torch.float32)
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or infinity; score every completion with a finite reward.")
    mean = r.mean(dim=-1, keepdim=True)
    std = r.std(dim=-1, correction=0, keepdim=True)
    advantages = (r - mean) / (std + eps)
    return torch.where(has_signal(r).unsqueeze(-1), advantages, torch.zeros_like(advantages))
