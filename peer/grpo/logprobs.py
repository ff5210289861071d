"""Per-token log-probabilities of sampled completions, computed the same way at sampling and at learning.

The clipped loss compares the learner's log-prob of each completion token with the *behaviour* log-prob the
rollout peer recorded when it sampled that token, and the learner spot-checks those recorded values. Both only
make sense if the two sides compute the same number for the same adapter, so this module fixes one layout and
one formula.

Batch layout (the one the rest of the project uses)::

    prompt_ids      [B, P]  int   prompts, LEFT-padded (as batched generate() needs)
    prompt_mask     [B, P]  0/1   1 on real prompt tokens: zeros then ones in every row
    completion_ids  [B, C]  int   sampled tokens, RIGHT-padded after the first eos (pad with any vocab id)
    -> logprobs     [B, C]  float32, logprobs[b, j] = log p(completion_ids[b, j] | prompt b, completion_ids[b, :j])
    completion_mask(completion_ids, eos_id) [B, C] bool: which of those positions are real completion tokens

The formula is ``log_softmax(logits / temperature)`` at the sampled token: plain temperature sampling, with
nothing truncated (see :class:`~peer.grpo.config.SamplingConfig`).

Position ids matter. With left padding a row's first real token is not at index 0, and HuggingFace
``generate()`` gives it position 0 anyway, counting positions over real tokens only. A forward pass over the
concatenated sequence passes the same ``position_ids = cumsum(attention_mask) - 1``. Rotary embeddings only see
relative positions, so Llama-style models come out close even without it; a model with learned absolute
positions (GPT-2 style) would see every padded row shifted and its log-probs would not match the recorded ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

CausalLM = Callable[..., Any]
"""A HuggingFace-style causal LM: ``model(input_ids=, attention_mask=, position_ids=).logits`` is [B, L, V]."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature)`` gathered at ``tokens``: logits [..., V], tokens [...] -> [...].

    Uses ``logit[token] - logsumexp(logits)`` so the full [..., V] log-softmax is never materialized.
    The result is float32 whatever the dtype of ``logits``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}.")
    if logits.dim() < 1 or logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits [..., V] and tokens [...] must agree on leading dims, got {tuple(logits.shape)} and "
            f"{tuple(tokens.shape)}."
        )
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}.")
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


@dataclass(frozen=True)
class TokenStats:
    """Each sampled token's log-prob with the mean and variance sampling would give it (all float32 [...]).

    Under honest sampling from ``p = softmax(logits / temperature)`` the sampled token's log-prob ``logprobs`` has
    mean ``-entropy`` (``H = -sum p log p``) and variance ``variance`` (``sum p (log p)^2 - H^2``). Summed over the
    many tokens of sampled text, ``(sum logprobs + sum entropy) / sqrt(sum variance)`` is then about N(0, 1); text
    the policy would not sample (chosen, or sampled from another policy) lands far out in its tails.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    variance: torch.Tensor


def token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> TokenStats:
    """:class:`TokenStats` of ``tokens`` under ``log_softmax(logits.float() / temperature)``: logits [..., V].

    ``logprobs`` are exactly :func:`token_logprobs`'s. Builds the full [..., V] distribution (a verifier's cost,
    not the loss's).
    """
    logprobs = token_logprobs(logits, tokens, temperature)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))  # 0 log 0 = 0 where a logit is -inf
    entropy = -plogp.sum(-1)
    second = (plogp * torch.where(p > 0, logp, torch.zeros_like(p))).sum(-1)
    return TokenStats(logprobs, entropy, (second - entropy * entropy).clamp(min=0.0))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(attention_mask.cumsum(-1) - 1).clamp(min=0)``: the positions ``generate()`` gives left-padded rows."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids: torch.Tensor, eos_id: int | Sequence[int]) -> torch.Tensor:
    """Which completion positions count: everything up to and including the first eos, bool [B, C].

    ``eos_id`` may be several ids (many chat models stop on more than one). A row without eos was cut at
    ``max_new_tokens`` and counts in full. Positions after the first eos are padding.
    """
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must have shape [B, C], got {tuple(completion_ids.shape)}.")
    eos = torch.as_tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=completion_ids.device)
    if eos.numel() == 0:
        raise ValueError("eos_id must name at least one token id.")
    is_eos = torch.isin(completion_ids, eos.to(completion_ids.dtype))
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    return eos_before == 0


def _check_prompt_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor) -> None:
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_ids and prompt_mask must both have shape [B, P], got {tuple(prompt_ids.shape)} and "
            f"{tuple(prompt_mask.shape)}."
        )
    if completion_ids.dim() != 2 or completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(
            f"completion_ids must have shape [B, C] with B = {prompt_ids.shape[0]} as in prompt_ids, "
            f"got {tuple(completion_ids.shape)}."
        )
    if prompt_ids.shape[1] < 1 or completion_ids.shape[1] < 1:
        raise ValueError(
            f"prompts and completions need at least one position each, got P={prompt_ids.shape[1]}, "
            f"C={completion_ids.shape[1]}."
        )
    valid = prompt_mask.bool()
    if not valid[:, -1].all() or (valid[:, :-1] & ~valid[:, 1:]).any():
        raise ValueError(
            "prompts must be left-padded (prompt_mask is zeros then ones in each row, ending in a real token); "
            "tokenize with padding_side='left'."
        )


def completion_logprobs(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
    *,
    logits_to_keep: bool | None = None,
    share_prompts: bool = False,
) -> torch.Tensor:
    """Log-prob of each completion token given its prompt and the completion before it: float32 [B, C].

    One forward pass over ``prompt_ids ++ completion_ids`` with the attention mask ``prompt_mask ++ ones`` and
    the position ids ``generate()`` uses, which reproduces the log-probs recorded at sampling. Tokens after a
    row's first eos are fed too, but causal attention keeps them from touching earlier positions; mask their
    log-probs out with :func:`completion_mask`.

    ``logits_to_keep`` (default: whenever the model's forward takes it, as HuggingFace causal LMs do) asks the model
    for the last ``C + 1`` positions' logits only, so the [B, P, V] prompt logits are never built: on a real
    vocabulary (SmolLM2: 49,152) with a chat-template prompt they were most of a learner's memory and a fifth of its
    forward. ``False`` builds them all.

    ``share_prompts``: rows next to each other with the same prompt (a GRPO group's G completions) run that prompt's
    forward once; its KV cache is copied to each of them and only the completions run per row
    (:func:`_shared_prompt_logits`). The same numbers to float rounding (~4e-6 nats on the bundled model), gradients
    included, for a fraction of the work where the prompt is long: a group of 8 with a 9-token prompt and 6 new
    tokens computes 912 positions instead of 1,920. A model without a KV cache (or with gradient checkpointing on,
    which turns the cache off) gets every row's own forward.
    Gradients flow into the model's parameters unless the caller runs this under ``torch.no_grad()``.
    """
    logits = completion_logits(
        model, prompt_ids, prompt_mask, completion_ids, logits_to_keep=logits_to_keep, share_prompts=share_prompts
    )
    return token_logprobs(logits, completion_ids, temperature)


def completion_logits(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    logits_to_keep: bool | None = None,
    share_prompts: bool = False,
) -> torch.Tensor:
    """The logits [B, C, V] that :func:`completion_logprobs` reads its log-probs from (the same options), for a
    caller that needs more of each position's distribution than the sampled token's log-prob."""
    return _logits(model, prompt_ids, prompt_mask, completion_ids, logits_to_keep, share_prompts)


IMPROBABLE_CHUNK = 1 << 24
"""Vocabulary entries :func:`improbable_tokens` holds at once (64 MiB of float32): a 49,152-token vocabulary goes
341 positions at a time, so its memory beside the update's stays small however large the micro-batch."""


def improbable_tokens(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ``tokens`` have a log-prob below ``floor`` under ``log_softmax(logits.float() / temperature)`` (bool
    [...]), and how often honest sampling would give one at each position: the probability of all the tokens below
    ``floor`` there (float32 [...]; its sum over many positions is the count honest sampled text would hold).

    Text that was sampled holds about as many improbable tokens as that sum says; text that was written holds
    what its writer put there. Computed without gradients (it is evidence, not a loss)."""
    if logits.dim() < 1 or logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits [..., V] and tokens [...] must agree on leading dims, got {tuple(logits.shape)} and "
            f"{tuple(tokens.shape)}."
        )
    vocab = logits.shape[-1]
    flat, ids = logits.detach().reshape(-1, vocab), tokens.reshape(-1).long()
    rare = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    expected = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    step = max(1, IMPROBABLE_CHUNK // vocab)  # positions at a time: one [step, V] float32 at most beside the logits
    with torch.no_grad():
        for i in range(0, flat.shape[0], step):
            logp = torch.log_softmax(flat[i : i + step].float() / temperature, dim=-1)
            rare[i : i + step] = logp.gather(-1, ids[i : i + step].unsqueeze(-1)).squeeze(-1) < floor
            likely = logp >= floor
            expected[i : i + step] = logp.exp_().masked_fill_(likely, 0.0).sum(-1)
            del logp, likely
    return rare.view(tokens.shape), expected.view(tokens.shape)


def _logits(model, prompt_ids, prompt_mask, completion_ids, logits_to_keep, share_prompts) -> torch.Tensor:
    """The completion logits [B, C, V], each run of equal prompts computed once where ``share_prompts`` can."""
    logits = None
    if share_prompts and not _checkpointing(model):
        logits = _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids)
    if logits is None:
        logits = _completion_logits(model, prompt_ids, prompt_mask, completion_ids, logits_to_keep)
    return logits


def _checkpointing(model) -> bool:
    """Whether the model recomputes activations in backward (its forward then returns no KV cache):
    ``is_activation_checkpointing``, or ``is_gradient_checkpointing`` in transformers that predate it (a deprecated
    alias now, warning at every read). Read off the class first, so neither property runs unless it exists."""
    inner = inner_model(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(inner), name):
            return bool(getattr(inner, name))
    return False


def prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that start a run of equal prompts (ids and mask) and each run's length: ``(starts, lengths)``."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)
    starts = torch.cat(
        [torch.zeros(1, dtype=torch.long, device=prompt_ids.device), same.logical_not().nonzero()[:, 0] + 1]
    )
    ends = torch.cat([starts[1:], torch.tensor([prompt_ids.shape[0]], device=prompt_ids.device)])
    return starts, ends - starts


def _shared_prompt_logits(
    model: CausalLM, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor
) -> torch.Tensor | None:
    """The logits of :func:`_completion_logits`, each run of equal prompts computed once: the prompts' forward (the
    last position's logits only), its KV cache rows copied to the rows of their run, then one forward of every row's
    completion but its last token on that cache. None when no two rows share a prompt, or the model gives no cache
    or one whose rows cannot be copied (the caller then computes every row's own forward)."""
    _check_prompt_layout(prompt_ids, prompt_mask, completion_ids)
    starts, lengths = prompt_runs(prompt_ids, prompt_mask)
    if starts.numel() == prompt_ids.shape[0]:
        return None
    first_ids, first_mask = prompt_ids[starts], prompt_mask[starts]
    keep = _keep_argument(model)
    out = model(
        input_ids=first_ids,
        attention_mask=first_mask,
        position_ids=position_ids_from_mask(first_mask),
        use_cache=True,
        **({keep: 1} if keep is not None else {}),
    )
    cache = cache_of(out)
    if cache is None:
        return None
    index = torch.repeat_interleave(torch.arange(starts.numel(), device=prompt_ids.device), lengths)
    first = out.logits[:, -1:, :][index]  # the last prompt position predicts the first completion token
    completion_len = completion_ids.shape[1]
    if completion_len == 1:
        return first
    try:
        cache = select_cache_rows(cache, index)
    except (TypeError, NotImplementedError, ValueError, AttributeError):  # a cache whose rows cannot be copied
        return None
    attention_mask = torch.cat(
        [
            prompt_mask,
            torch.ones(prompt_mask.shape[0], completion_len - 1, dtype=prompt_mask.dtype, device=prompt_mask.device),
        ],
        dim=1,
    )
    rest = model(
        input_ids=completion_ids[:, :-1].to(prompt_ids.dtype),
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, prompt_ids.shape[1] :],
        **{cache_argument(model): cache},
    ).logits
    if rest.dim() != 3 or rest.shape[:2] != (prompt_ids.shape[0], completion_len - 1):
        raise ValueError(
            f"model returned logits of shape {tuple(rest.shape)} for {completion_len - 1} completion positions"
        )
    return torch.cat([first, rest], dim=1)


def inner_model(model):
    """The model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_argument(model) -> str:
    """The forward() keyword that carries the KV cache: ``cache`` in newer transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(inner_model(model).forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward returned (``cache`` or ``past_key_values``), or None."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def select_cache_rows(cache, index: torch.Tensor):
    """Only the batch rows ``index`` of a KV cache, in that order (rows may repeat; in place for a ``Cache``
    object); returns the cache."""
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(index)
        return cache
    if isinstance(cache, (tuple, list)):  # the legacy per-layer (key, value) tuples
        return tuple(tuple(t[index] for t in layer) for layer in cache)
    raise TypeError(f"cannot select rows of a KV cache of type {type(cache).__name__}")


def _completion_logits(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    logits_to_keep: bool | None,
) -> torch.Tensor:
    """The logits [B, C, V] that predict each completion token (see :func:`completion_logprobs`)."""
    _check_prompt_layout(prompt_ids, prompt_mask, completion_ids)
    completion_len = completion_ids.shape[1]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids, dtype=prompt_mask.dtype)], dim=1)
    kwargs: dict[str, Any] = {
        "input_ids": torch.cat([prompt_ids, completion_ids.to(prompt_ids.dtype)], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }
    keep = _keep_argument(model) if logits_to_keep is not False else None
    if logits_to_keep and keep is None:
        keep = "logits_to_keep"  # asked for explicitly: the model must take it
    if keep is not None:
        kwargs[keep] = completion_len + 1
    logits = model(**kwargs).logits
    if logits.dim() != 3 or logits.shape[0] != prompt_ids.shape[0] or logits.shape[1] < completion_len + 1:
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)}; expected [B={prompt_ids.shape[0]}, "
            f">= {completion_len + 1}, V]."
        )
    # The logit at position t predicts token t + 1: the last prompt position predicts the first completion token.
    return logits[:, -(completion_len + 1) : -1]


def _keep_argument(model) -> str | None:
    """The forward() keyword that limits which positions get logits (``logits_to_keep``, ``num_logits_to_keep``
    before transformers 4.50), or None when the model's forward takes neither."""
    forward = getattr(inner_model(model), "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        return None
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)


def completion_token_stats(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
    *,
    logits_to_keep: bool | None = None,
    share_prompts: bool = False,
) -> TokenStats:
    """:func:`completion_logprobs` (the same forward pass, the same ``logprobs``) with each token's
    :class:`TokenStats`, float32 [B, C]; for a verifier, so run it under ``torch.no_grad()``."""
    logits = _logits(model, prompt_ids, prompt_mask, completion_ids, logits_to_keep, share_prompts)
    return token_stats(logits, completion_ids, temperature)


def sequence_logprobs(
    model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-prob of every token given the ones before it, for any padded layout: float32 [B, L - 1].

    ``out[:, t]`` is ``log p(input_ids[:, t + 1] | input_ids[:, : t + 1])``; entries where the predicted token
    is padding are meaningless. Prefer :func:`completion_logprobs` for the prompt + completion layout.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids and attention_mask must both have shape [B, L] with L >= 2, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}."
        )
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
