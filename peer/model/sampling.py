"""Sampling completions with the per-token log-probs of the exact policy that sampled them.

A small decoding loop over the model's KV cache instead of ``generate()``: it samples from exactly
``softmax(logits / temperature)`` (no hidden top-k/top-p or repetition processors from a hub
``generation_config``), records the log-prob of every sampled token as it goes (the *behaviour* log-probs a learner
corrects against), and takes an explicit ``torch.Generator`` so a batch is reproducible from its seed.

Layout (shared with :mod:`peer.grpo.logprobs`): prompts left-padded ``[B, P]`` with their attention mask,
completions right-padded ``[B, C]``; ``completion_mask`` is True for generated tokens up to and including the first
end token (any of :func:`peer.model.prompts.end_token_ids`), or up to the token that completed a stop string.

A group's prompt is computed once: :func:`sample_groups` runs the prefill on each distinct prompt and copies its
KV-cache rows to the group's ``G`` rows (``decode(..., repeats=G)``); on the bundled model the prefill of every
row was about 40 % of the sampling time. A finished row costs nothing: once a row ends, it leaves the batch (its
KV-cache rows are dropped), so each step's forward runs only on the rows still decoding, and the prefill computes
logits for the last position only. Rows do not influence each other: a row's tokens and log-probs are the same
whether its finished neighbours stay in the batch or not (``compact=False`` keeps them, for the test that checks
exactly that), and the random draws of a step are taken for the live rows in batch order, so a batch is
reproducible from its generator's seed.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from peer.grpo.config import PromptConfig
from peer.grpo.logprobs import cache_argument as _cache_argument
from peer.grpo.logprobs import cache_of as _cache_of
from peer.grpo.logprobs import inner_model as _inner
from peer.grpo.logprobs import select_cache_rows as _select_rows
from peer.model.prompts import completion_text, end_token_ids, prompt_ids

STOP_WINDOW_EXTRA = 4  # tokens decoded beyond a stop string's length when looking for it in a row's tail


@dataclass
class Completions:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long (1 = real token)
    completion_ids: torch.Tensor  # [B, C] long, pad after the first end token
    completion_mask: torch.Tensor  # [B, C] bool
    logprobs: torch.Tensor  # [B, C] float32, behaviour log-probs (0 where masked)

    def texts(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> list[str]:
        """The text each completion's reward sees; ``stop``: the run's stop strings (``PromptConfig.stop``)."""
        return decode_completions(tokenizer, self.completion_ids, self.completion_mask, stop)


def decode_completions(
    tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor, stop: Sequence[str] = ()
) -> list[str]:
    """The text each completion's reward sees (:func:`peer.model.prompts.completion_text`)."""
    out = []
    for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist(), strict=True):
        out.append(completion_text(tokenizer, [t for t, m in zip(ids, mask, strict=True) if m], stop))
    return out


def pad_left(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as a left-padded ``[B, P]`` batch and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def encode_prompts(
    tokenizer, prompts: list[str], device: torch.device, prompt: PromptConfig = PromptConfig()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each question rendered by :func:`peer.model.prompts.prompt_ids`, left-padded into one batch."""
    rendered: dict[str, list[int]] = {}
    for text in prompts:
        if text not in rendered:  # a group repeats its prompt G times
            rendered[text] = prompt_ids(tokenizer, prompt, text)
    return pad_left([rendered[t] for t in prompts], tokenizer.pad_token_id, device)


def _last_logits_argument(model) -> dict[str, int]:
    """The forward() keyword asking for the last position's logits only (``logits_to_keep`` in transformers >= 4.50,
    ``num_logits_to_keep`` before; none on models without it): a prompt's other logits are never used, and on a
    large vocabulary they are most of the prefill's memory."""
    params = inspect.signature(_inner(model).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def _repeat_rows(cache, repeats: int):
    """Each batch row of a KV cache ``repeats`` times in a row (in place for a ``Cache`` object); returns the cache,
    or None for a cache this cannot copy rows of (the caller then computes every row's prefill)."""
    if hasattr(cache, "batch_repeat_interleave"):
        try:
            cache.batch_repeat_interleave(repeats)
        except (NotImplementedError, ValueError, TypeError, AttributeError):
            return None
        return cache
    if isinstance(cache, (tuple, list)):
        return tuple(tuple(t.repeat_interleave(repeats, dim=0) for t in layer) for layer in cache)
    return None


class _StopWatch:
    """Finds the rows whose text now contains a stop string, decoding only each row's last tokens."""

    def __init__(self, tokenizer, stop: Sequence[str], batch: int):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.window = max(len(s) for s in self.stop) + STOP_WINDOW_EXTRA
        self.tokens: list[list[int]] = [[] for _ in range(batch)]

    def hit(self, rows: list[int], tokens: list[int], ended: list[bool]) -> list[bool]:
        """Append ``tokens`` to ``rows``; True where a row that did not end on an end token now holds a stop string."""
        for r, t in zip(rows, tokens, strict=True):
            self.tokens[r].append(t)
        look = [i for i, e in enumerate(ended) if not e]
        if not look:
            return [False] * len(rows)
        texts = self.tokenizer.batch_decode(
            [self.tokens[rows[i]][-self.window :] for i in look], skip_special_tokens=True
        )
        out = [False] * len(rows)
        for i, text in zip(look, texts, strict=True):
            out[i] = any(s in text for s in self.stop)
        return out


@torch.no_grad()
def decode(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int | Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    stop: Sequence[str] = (),
    tokenizer=None,
    compact: bool = True,
    repeats: int = 1,
) -> Completions:
    """Decode up to ``max_new_tokens`` per row; greedy takes the argmax (its log-probs are still recorded).

    ``repeats``: each prompt row is decoded that many times, as rows ``r * repeats`` to ``r * repeats + repeats - 1``
    of the result (a GRPO group); the prompt's forward runs once and its KV-cache rows are copied.

    A row ends at any token of ``eos_id`` (one id or several) or, given ``stop`` strings and the ``tokenizer`` to
    read them with, at the token after which its text contains one. ``compact=False`` keeps finished rows in every
    forward (as this loop did before rows left the batch); the results are the same, only slower.
    """
    if repeats < 1:
        raise ValueError(f"decode needs repeats >= 1, got {repeats}.")
    device = prompt_ids.device
    ends = torch.as_tensor([eos_id] if isinstance(eos_id, int) else sorted(set(eos_id)), device=device)
    if ends.numel() == 0:
        raise ValueError("decode needs at least one end-of-sequence token id.")
    if stop and tokenizer is None:
        raise ValueError("decode needs the tokenizer to look for stop strings.")
    cache_arg = _cache_argument(model)
    cache, logits = _prefill(model, prompt_ids, prompt_mask, repeats)
    if repeats > 1:
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(repeats, 0), prompt_mask.repeat_interleave(repeats, 0)
    batch = prompt_ids.shape[0]
    watch = _StopWatch(tokenizer, stop, batch) if stop else None
    ids = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    keep = torch.zeros(batch, max_new_tokens, dtype=torch.bool, device=device)
    logps = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
    mask = prompt_mask.clone()
    next_pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:] + 1
    rows = torch.arange(batch, device=device)  # the batch rows in the forward, in order
    live = None  # compact=False: which rows of the forward still decode (None: all of them)
    steps = 0
    for step in range(max_new_tokens):
        steps = step + 1
        scores = (logits if live is None else logits[live]).float() / (1.0 if greedy else temperature)
        lp = torch.log_softmax(scores, dim=-1)
        if greedy:
            token = lp.argmax(dim=-1)
        else:
            token = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
        at = rows if live is None else rows[live]
        ids[at, step] = token
        keep[at, step] = True
        logps[at, step] = lp.gather(-1, token[:, None]).squeeze(-1)
        done = torch.isin(token, ends)
        if watch is not None:
            hits = watch.hit(at.tolist(), token.tolist(), done.tolist())
            done = done | torch.tensor(hits, dtype=torch.bool, device=device)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if compact:
            if bool(done.any()):  # finished rows leave the batch, with their KV-cache rows
                still = (~done).nonzero().squeeze(-1)
                rows, token, mask, next_pos = rows[still], token[still], mask[still], next_pos[still]
                cache = _select_rows(cache, still)
            feed = token
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        else:  # finished rows stay, fed padding that nothing attends to
            now = torch.ones_like(rows, dtype=torch.bool) if live is None else live.clone()
            now[now.clone()] = ~done
            feed = torch.full_like(rows, pad_id)
            feed[now] = token[~done]
            mask = torch.cat([mask, now.long()[:, None]], dim=1)
            live = now
        out = model(
            input_ids=feed[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_arg: cache},
        )
        cache, logits = _cache_of(out), out.logits[:, -1, :]
        next_pos = next_pos + 1
    return Completions(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids[:, :steps],
        completion_mask=keep[:, :steps],
        logprobs=logps[:, :steps],
    )


def _prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, repeats: int):
    """The KV cache and last-position logits of the prompts, each row then ``repeats`` times in a row."""

    def forward(ids, mask):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **_last_logits_argument(model),
        )
        return _cache_of(out), out.logits[:, -1, :]

    cache, logits = forward(prompt_ids, prompt_mask)
    if repeats == 1:
        return cache, logits
    copied = _repeat_rows(cache, repeats)
    if copied is None:  # a cache type whose rows cannot be copied: every row's own prefill, as before
        del cache
        return forward(prompt_ids.repeat_interleave(repeats, 0), prompt_mask.repeat_interleave(repeats, 0))
    return copied, logits.repeat_interleave(repeats, 0)


def sample_groups(
    model,
    tokenizer,
    prompts: list[str],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    device: torch.device,
    generator: torch.Generator | None = None,
    prompt: PromptConfig = PromptConfig(),
    compact: bool = True,
) -> Completions:
    """``group_size`` sampled completions of every prompt, rows ordered prompt-major (row = p * G + g).

    Prompts are rendered with the run's ``prompt`` settings; rows end at any of the model's end tokens or its
    stop strings."""
    ids, mask = encode_prompts(tokenizer, prompts, device, prompt)
    return decode(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_id=end_token_ids(model, tokenizer),
        pad_id=tokenizer.pad_token_id,
        temperature=temperature,
        generator=generator,
        stop=prompt.stop,
        tokenizer=tokenizer,
        compact=compact,
        repeats=group_size,
    )


def sample_run(
    model,
    tokenizer,
    prompts: list[str],
    sampling,
    prompt: PromptConfig,
    *,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> Completions:
    """:func:`sample_groups` with a run's settings: ``sampling`` (a :class:`~peer.grpo.SamplingConfig`: G, length,
    temperature) and its ``prompt`` rendering — how a run's groups are sampled, in one place."""
    return sample_groups(
        model,
        tokenizer,
        prompts,
        group_size=sampling.group_size,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        device=device,
        generator=generator,
        prompt=prompt,
    )


def greedy_texts(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    device: torch.device,
    prompt: PromptConfig = PromptConfig(),
) -> list[str]:
    """The greedy completion of each prompt, as the text a reward sees."""
    ids, mask = encode_prompts(tokenizer, prompts, device, prompt)
    done = decode(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_id=end_token_ids(model, tokenizer),
        pad_id=tokenizer.pad_token_id,
        greedy=True,
        stop=prompt.stop,
        tokenizer=tokenizer,
    )
    return done.texts(tokenizer, prompt.stop)
