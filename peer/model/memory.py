"""Memory: what one sampled row costs, how many prompts fit a budget, and backing off when memory runs out.

A rollout peer samples ``batch x G`` rows at once with a KV-cache decode loop. Per row it holds, at the model's
compute dtype, the KV cache of every layer over prompt + completion, one layer's prefill activations at a time
(the forward runs under ``no_grad``, so a layer's are freed once the next has its input), and, in float32, the
decode step's logits and what sampling builds from them (the upcast, the scaled logits, log-softmax,
probabilities, multinomial's work). :func:`row_bytes` counts exactly those; the prefill keeps the logits of its
last position only (``logits_to_keep=1``). ``--batch-size auto`` divides the budget by it (:func:`auto_batch_size`).

An estimate can be wrong, and free memory changes under a running peer. :func:`in_batches` samples a batch's
prompts in chunks and, when a chunk runs out of memory (CUDA's ``OutOfMemoryError``, ``MemoryError``, the CPU
allocator's failure) or its estimate exceeds ``--max-memory``, halves the chunk and retries the same prompts;
the size found is kept. A learner's micro-batches back off the same way (:func:`retry_halving`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import torch

from peer.errors import UserError
from peer.log import get_logger

logger = get_logger(__name__)

T = TypeVar("T")

CPU_BATCH_CAP = 16  # prompts; on the bundled model (1 thread) 16 prompts x 8 reach 0.90x the rate of 64 prompts
CUDA_BATCH_CAP = 64
SAMPLED_PROMPTS = 8  # prompts rendered to find the longest one for the estimate
COPY_SHARE = 4  # without --max-memory, a copy the model keeps (unpacked, merged) may take a quarter of the free RAM
FLOAT32_VOCAB_COPIES = 8  # float32 [V] tensors per row around a decode step (measured: ~7 on CPU; row_bytes)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_memory(text: str, option: str = "--max-memory") -> int:
    """Bytes in ``"800MB"``, ``"6GiB"``, ``"1.5 GB"`` or ``"123456"`` (decimal or binary units); ValueError else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(text), re.IGNORECASE)
    if match is None:
        raise ValueError(f"{option} must look like 800MB or 6GiB, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"{option} must be at least one byte, got {text!r}")
    return value


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def compute_dtype(model) -> torch.dtype:
    """The dtype the model's hidden states (and so its KV cache) have: that of its first floating parameter (the
    embeddings; a quantized model's packed weights are integers and skipped)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers as held (a 4-bit weight counts its packed bytes)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def room_for(model, need: int, max_memory: int | None) -> str | None:
    """None if ``need`` more bytes held beside ``model`` fit, else why not: with ``max_memory`` (a rollout peer's
    ``--max-memory``), the model with them may take at most half of it (the rest is its batches'); without, they may
    take at most a quarter of the RAM available now (:data:`COPY_SHARE`). Unpacking a 4-bit base and keeping the
    base weights of a merged LoRA ask this before they copy anything."""
    if max_memory is not None:
        after = model_bytes(model) + need
        if after > max_memory // 2:
            return f"the model would take {mib(after)}, more than half of --max-memory {mib(max_memory)}"
        return None
    import psutil

    available = psutil.virtual_memory().available
    if need > available // COPY_SHARE:
        return f"a copy of {mib(need)} would take more than a quarter of the available {mib(available)}"
    return None


def row_bytes(config, dtype: torch.dtype, prompt_tokens: int, max_new_tokens: int) -> int:
    """Upper estimate of the memory one sampled row needs at the decode loop's peak, in bytes.

    ``config`` is the model's (HuggingFace names: ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size``); ``dtype`` its compute dtype.
    The terms are summed although the prefill's activations are gone before the cache is full: an upper bound.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_width = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    vocab, P = config.vocab_size, prompt_tokens
    tokens = prompt_tokens + max_new_tokens
    # keys and values of every layer over every token, and the copy the cache makes of one layer as it grows
    kv = 2 * (layers + 1) * kv_width * tokens * elem
    # one layer's prefill: residual, norm, attention in/out (q and o at ``heads x head_dim``, k, v), the MLP's
    # gate, up, activation and product, and the attention's float32 scores and softmax over the prompt
    width = 4 * hidden + 2 * heads * head_dim + 2 * kv_width + 4 * inter
    prefill = P * width * elem + 2 * heads * P * P * 4
    # the decode step: the last position's logits at the model's dtype, then in float32 the upcast, the scaled
    # logits, log-softmax, probabilities, and multinomial's noise and quotient
    logits = vocab * elem + FLOAT32_VOCAB_COPIES * vocab * 4
    return kv + prefill + logits


def memory_budget(model, device: torch.device, max_memory: int | None) -> tuple[int, int]:
    """``(bytes a batch may use, cap in prompts)``. Without ``max_memory``: half the free GPU memory (CUDA) or a
    quarter of the available RAM (CPU), room left for others. With it: ``max_memory`` less the model's own bytes,
    and never more than is free."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share, cap = free // 2, CUDA_BATCH_CAP
    else:
        import psutil

        free = psutil.virtual_memory().available
        share, cap = free // 4, CPU_BATCH_CAP
    if max_memory is None:
        return share, cap
    held = model_bytes(model)
    if held >= max_memory:
        raise UserError(
            f"the model alone takes {mib(held)}, more than --max-memory {mib(max_memory)}: raise --max-memory or "
            "load the base smaller (--quantization nf4)"
        )
    return min(free, max_memory - held), cap


def auto_batch_size(
    model,
    device: torch.device,
    group_size: int,
    prompt_tokens: int,
    max_new_tokens: int,
    max_memory: int | None = None,
) -> int:
    """Prompts per batch whose :func:`row_bytes` fit :func:`memory_budget`, at least 1 and at most the cap."""
    per_prompt = group_size * row_bytes(model.config, compute_dtype(model), prompt_tokens, max_new_tokens)
    budget, cap = memory_budget(model, device, max_memory)
    return max(1, min(cap, budget // per_prompt))


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's (or torch's) ``OutOfMemoryError``, Python's ``MemoryError``, or the CPU allocator's failure."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def release_memory() -> None:
    """Give the failed attempt's cached blocks back before the retry (the exception and its frames are gone)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def halve(size: int, floor: int, what: str, advice: str, why: str = "") -> int:
    """The next size to try after ``size`` ran out of memory, logged once; UserError at ``floor``."""
    detail = f" ({why})" if why else ""
    if size <= floor:
        raise UserError(f"out of memory at {size} {what}{detail}: {advice}")
    smaller = max(floor, size // 2)
    logger.warning("out of memory at %d %s%s; halving to %d", size, what, detail, smaller)
    return smaller


SAMPLING_ADVICE = (
    "this peer cannot sample even one prompt's group; give it more memory (a larger --max-memory, another "
    "machine or GPU) or hold the base smaller (--quantization nf4)"
)


def in_batches(
    work: Callable[[int, int], T],
    count: int,
    size: int,
    *,
    check: Callable[[int, int], str | None] | None = None,
    what: str = "prompts per batch",
    advice: str = SAMPLING_ADVICE,
) -> tuple[list[T], int]:
    """``work(start, stop)`` over ``range(count)`` in consecutive chunks of at most ``size``; returns the results
    in order and the size that worked.

    A chunk whose ``check(start, stop)`` gives a reason (an estimate over budget), or whose ``work`` runs out of
    memory, is halved and retried from the same ``start``: what was done is kept, nothing is skipped or repeated.
    Below one item there is nothing to halve: :class:`~peer.errors.UserError` with ``advice``.
    """
    done: list[T] = []
    start = 0
    while start < count:
        stop = min(count, start + size)
        why = check(start, stop) if check is not None else None
        if why is None:
            try:
                done.append(work(start, stop))
                start = stop
                continue
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                if not is_out_of_memory(e):
                    raise
            release_memory()
        size = halve(stop - start, 1, what, advice, why or "")
    return done, size


def retry_halving(work: Callable[[int], T], size: int, *, floor: int, what: str, advice: str) -> tuple[T, int]:
    """``work(size)``, halving ``size`` (down to ``floor``) while it runs out of memory; returns the result and the
    size that worked. ``work`` must start afresh each time (a learner's step accumulates nothing across tries)."""
    while True:
        try:
            return work(size), size
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
        release_memory()
        size = halve(size, floor, what, advice)


__all__ = [
    "CPU_BATCH_CAP",
    "CUDA_BATCH_CAP",
    "auto_batch_size",
    "compute_dtype",
    "halve",
    "in_batches",
    "is_out_of_memory",
    "memory_budget",
    "model_bytes",
    "parse_memory",
    "retry_halving",
    "row_bytes",
]
