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
"""

from peer.grpo.advantages import group_advantages, has_signal
from peer.grpo.config import LossConfig, PromptConfig, SamplingConfig, StalenessConfig
from peer.grpo.logprobs import (
    completion_logprobs,
    completion_mask,
    position_ids_from_mask,
    sequence_logprobs,
    token_logprobs,
)
from peer.grpo.loss import LossStats, clipped_policy_loss
from peer.grpo.staleness import WEIGHTINGS, accept, staleness, staleness_weight, staleness_weights

__all__ = [
    "WEIGHTINGS",
    "LossConfig",
    "LossStats",
    "PromptConfig",
    "SamplingConfig",
    "StalenessConfig",
    "accept",
    "clipped_policy_loss",
    "completion_logprobs",
    "completion_mask",
    "group_advantages",
    "has_signal",
    "position_ids_from_mask",
    "sequence_logprobs",
    "staleness",
    "staleness_weight",
    "staleness_weights",
    "token_logprobs",
]
