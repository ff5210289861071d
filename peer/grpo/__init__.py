"""GRPO math for asynchronous peers: pure torch functions and frozen configs, no network, no model library.

* :mod:`~peer.grpo.config` — sampling, loss and staleness hyperparameters, as they go into the run manifest.
* :mod:`~peer.grpo.advantages` — group-normalized advantages, the baseline that replaces a critic.
* :mod:`~peer.grpo.logprobs` — the batch layout and the one formula for per-token log-probs, shared by the
  rollout peer that records behaviour log-probs and the learner that recomputes them.
* :mod:`~peer.grpo.loss` — the clipped ratio against the behaviour policy, token-mean, optional KL to the base.
* :mod:`~peer.grpo.staleness` — which stale groups to drop and how much the rest count.

A learner step composes them::

    tau = staleness(learner_version, group.version)           # drop the group unless accept(tau, cfg)
    adv = group_advantages(rewards, loss_cfg.adv_eps)          # [G], zeros if not has_signal(rewards)
    logp = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, sampling_cfg.temperature)
    mask = completion_mask(completion_ids, eos_id)
    loss, stats = clipped_policy_loss(logp, group.behaviour_logprobs, adv, mask, weights, loss_cfg)

Importing the package costs no torch: the configs and the staleness rules load with it (a manifest is parsed
with them before any model is), the torch math on first use of one of its names (PEP 562 ``__getattr__``).
``staleness`` loads with the package because it names both a submodule and its function: loaded later, the
import system would rebind ``peer.grpo.staleness`` to the submodule.
"""

import importlib
from typing import TYPE_CHECKING, Any

from peer.grpo.config import WEIGHTING_NAMES, LossConfig, PromptConfig, SamplingConfig, StalenessConfig
from peer.grpo.staleness import WEIGHTINGS, accept, staleness, staleness_weight, staleness_weights

if TYPE_CHECKING:
    from peer.grpo.advantages import group_advantages, has_signal
    from peer.grpo.logprobs import (
        completion_logits,
        completion_logprobs,
        completion_mask,
        improbable_tokens,
        position_ids_from_mask,
        sequence_logprobs,
        token_logprobs,
    )
    from peer.grpo.loss import LossStats, clipped_policy_loss

_LAZY = {
    "advantages": ("group_advantages", "has_signal"),
    "logprobs": (
        "completion_logits",
        "completion_logprobs",
        "completion_mask",
        "improbable_tokens",
        "position_ids_from_mask",
        "sequence_logprobs",
        "token_logprobs",
    ),
    "loss": ("LossStats", "clipped_policy_loss"),
}
_SUBMODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """A torch submodule (``advantages``, ``logprobs``, ``loss``) or one of its names, imported on first use."""
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    module = _SUBMODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULE_OF))


__all__ = [
    "WEIGHTINGS",
    "WEIGHTING_NAMES",
    "LossConfig",
    "LossStats",
    "PromptConfig",
    "SamplingConfig",
    "StalenessConfig",
    "accept",
    "clipped_policy_loss",
    "completion_logits",
    "completion_logprobs",
    "completion_mask",
    "group_advantages",
    "has_signal",
    "improbable_tokens",
    "position_ids_from_mask",
    "sequence_logprobs",
    "staleness",
    "staleness_weight",
    "staleness_weights",
    "token_logprobs",
]
