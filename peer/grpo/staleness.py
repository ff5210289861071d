"""Staleness: how far behind the learner a rollout group is, whether to use it, and how much it counts.

Rollout peers never wait for learners, so a group reaches a learner after the adapter it was sampled with has
been replaced. Its *staleness* is ``tau = learner_version - group_version``:

* ``tau < 0`` means the group claims an adapter version the learner has not reached yet. No honest peer can
  produce one, so it is rejected rather than clamped.
* ``tau > tau_max`` is dropped. The clipped ratio in :mod:`peer.grpo.loss` corrects for a policy that has moved,
  but only within its band: a group that is many versions old has most tokens clipped, contributes little
  gradient, and spends the learner's time.
* Every accepted group is weighted by ``w(tau)``, a pure, non-increasing function with ``w(0) == 1``: a fresh
  group counts fully, an older one somewhat less.

The weighting functions live in :data:`WEIGHTINGS`, keyed by the names of
:data:`~peer.grpo.config.WEIGHTING_NAMES` that :class:`~peer.grpo.config.StalenessConfig` stores in the run
manifest, so adding a weighting means adding its name there and its function here, never another branch in the
learner (tests/unit/test_grpo_staleness.py checks that both agree).

Only :func:`staleness_weights` builds a tensor; it imports torch when called, so that importing this module (as
``peer.grpo`` does) costs nothing to a process that only parses a manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from peer.grpo.config import StalenessConfig

if TYPE_CHECKING:
    import torch

Weighting = Callable[[int, StalenessConfig], float]


def constant(tau: int, config: StalenessConfig) -> float:
    """Every accepted group counts fully: ``w = 1``. Staleness then only decides what is dropped."""
    return 1.0


def polynomial(tau: int, config: StalenessConfig) -> float:
    """``w = (1 + tau) ** -power``: a gentle tail (``power = 0.5`` gives 1, 0.71, 0.58, 0.5, 0.45 for tau 0..4)."""
    return float((1 + tau) ** -config.power)


def exponential(tau: int, config: StalenessConfig) -> float:
    """``w = decay ** tau``: each version of lag multiplies the weight by ``decay``."""
    return float(config.decay**tau)


def hinge(tau: int, config: StalenessConfig) -> float:
    """``w = 1`` up to ``knee`` versions of lag, then linear down to 0 at ``tau_max + 1``.

    The zero sits one past ``tau_max`` so the oldest accepted group still counts a little; with ``knee == tau_max``
    this is the constant weighting.
    """
    if tau <= config.knee:
        return 1.0
    return float(config.tau_max + 1 - tau) / float(config.tau_max + 1 - config.knee)


WEIGHTINGS: dict[str, Weighting] = {
    "constant": constant,
    "polynomial": polynomial,
    "exponential": exponential,
    "hinge": hinge,
}
"""Staleness weighting functions by the name stored in :class:`~peer.grpo.config.StalenessConfig`: one for each of
:data:`~peer.grpo.config.WEIGHTING_NAMES`, and no other."""


def staleness(learner_version: int, group_version: int) -> int:
    """``learner_version - group_version``; negative when the group claims a version from the future."""
    for name, value in (("learner_version", learner_version), ("group_version", group_version)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int adapter version, got {value!r}.")
    return learner_version - group_version


def accept(tau: int, config: StalenessConfig) -> bool:
    """Whether a group ``tau`` versions behind may be used: ``0 <= tau <= tau_max``."""
    return 0 <= tau <= config.tau_max


def staleness_weight(tau: int, config: StalenessConfig) -> float:
    """The weight ``w(tau)`` of an accepted group, in ``(0, 1]``.

    Raises ValueError for a ``tau`` that :func:`accept` rejects: such a group must be dropped, not weighted.
    """
    if isinstance(tau, bool) or not isinstance(tau, int):
        raise ValueError(f"tau must be an int number of versions, got {tau!r}.")
    if not accept(tau, config):
        raise ValueError(
            f"tau={tau} is outside the accepted window [0, tau_max={config.tau_max}]; drop the group (see accept())."
        )
    return WEIGHTINGS[config.weighting](tau, config)


def staleness_weights(taus: torch.Tensor | Iterable[int], config: StalenessConfig) -> torch.Tensor:
    """:func:`staleness_weight` for each entry of ``taus``, as a float32 tensor of the same shape.

    A batch holds a handful of groups, so this loops in Python; every ``tau`` must be accepted.
    """
    import torch

    if isinstance(taus, torch.Tensor):
        if taus.is_floating_point() or taus.is_complex() or taus.dtype == torch.bool:
            raise ValueError(f"taus must be an integer tensor, got dtype {taus.dtype}.")
        shape, values, device = taus.shape, taus.flatten().tolist(), taus.device
    else:
        values = list(taus)
        shape, device = (len(values),), None
    weights = [staleness_weight(tau, config) for tau in values]
    return torch.tensor(weights, dtype=torch.float32, device=device).reshape(shape)
