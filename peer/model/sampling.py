"""Sampling completions with the per-token log-probs of the exact policy that sampled them.

A small decoding loop over the model's KV cache instead of ``generate()``: it samples from exactly
``softmax(logits / temperature)`` (no hidden top-k/top-p or repetition processors from a hub
``generation_config``), records the log-prob of every sampled token as it goes (the *behaviour* log-probs a learner
corrects against), and takes an explicit ``torch.Generator`` so a batch is reproducible from its seed.

Layout (shared with :mod:`peer.grpo.logprobs`): prompts left-padded ``[B, P]`` with their attention mask,
completions right-padded ``[B, C]``; ``completion_mask`` is True for generated tokens up to and including the first
end-of-sequence token.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


@dataclass
class Completions:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long (1 = real token)
    completion_ids: torch.Tensor  # [B, C] long, pad after the first eos
    completion_mask: torch.Tensor  # [B, C] bool
    logprobs: torch.Tensor  # [B, C] float32, behaviour log-probs (0 where masked)

    def texts(self, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        return decode_completions(tokenizer, self.completion_ids, self.completion_mask)


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Text of each completion, cut at its first eos, special tokens dropped."""
    out = []
    for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist(), strict=True):
        kept = [t for t, m in zip(ids, mask, strict=True) if m]
        out.append(tokenizer.decode(kept, skip_special_tokens=True))
    return out


def encode_prompts(tokenizer, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=True)
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def _cache_argument(model) -> str:
    """The forward() keyword that carries the KV cache: ``cache`` in newer transformers, ``past_key_values`` before."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@torch.no_grad()
def decode(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Completions:
    """Decode up to ``max_new_tokens`` per row; greedy takes the argmax (its log-probs are still recorded)."""
    batch = prompt_ids.shape[0]
    device = prompt_ids.device
    cache_arg = _cache_argument(model)
    mask = prompt_mask.clone()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    next_pos = positions[:, -1:] + 1
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    ids, keep, logps = [], [], []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float() / (1.0 if greedy else temperature)
        logp = torch.log_softmax(logits, dim=-1)
        if greedy:
            token = logp.argmax(dim=-1)
        else:
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        alive = ~finished
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        ids.append(token)
        keep.append(alive)
        logps.append(torch.where(alive, logp.gather(-1, token[:, None]).squeeze(-1), torch.zeros_like(logits[:, 0])))
        finished = finished | (token == eos_id)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, alive.long()[:, None]], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_arg: _cache_of(out)},
        )
        next_pos = next_pos + 1
    return Completions(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=torch.stack(ids, dim=1),
        completion_mask=torch.stack(keep, dim=1),
        logprobs=torch.stack(logps, dim=1),
    )


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
) -> Completions:
    """``group_size`` sampled completions of every prompt, rows ordered prompt-major (row = p * G + g)."""
    repeated = [p for p in prompts for _ in range(group_size)]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, repeated, device)
    return decode(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=temperature,
        generator=generator,
    )


def greedy_texts(model, tokenizer, prompts: list[str], *, max_new_tokens: int, device: torch.device) -> list[str]:
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
    done = decode(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        greedy=True,
    )
    return done.texts(tokenizer)
