"""Greedy exact match on a task's held-out set: the one number every result in this project is judged by."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from peer.grpo.config import PromptConfig
from peer.model.sampling import greedy_texts
from peer.tasks import Task


@dataclass(frozen=True)
class EvalResult:
    exact_match: float
    n: int
    correct: int
    seed: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def exact_match(
    model,
    tokenizer,
    task: Task,
    *,
    n: int = 500,
    seed: int = 0,
    max_new_tokens: int = 6,
    batch_size: int = 250,
    device: torch.device | None = None,
    prompt: PromptConfig = PromptConfig(),
) -> EvalResult:
    """Fraction of ``task.heldout(n, seed)`` answered exactly right by greedy decoding, each question rendered
    with the run's ``prompt`` settings (chat template, system prompt, stop strings) as the rollout peers sample it."""
    device = device or next(model.parameters()).device
    examples = task.heldout(n, seed)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    correct = 0
    try:
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            texts = greedy_texts(
                model,
                tokenizer,
                [e.prompt for e in chunk],
                max_new_tokens=max_new_tokens,
                device=device,
                prompt=prompt,
            )
            correct += sum(task.is_correct(t, e) for t, e in zip(texts, chunk, strict=True))
    finally:
        model.train(was_training)
    return EvalResult(correct / len(examples), len(examples), correct, seed, time.perf_counter() - start)


def evaluate_model(
    model_config,
    task,
    adapter_path=None,
    *,
    n: int,
    seed: int,
    max_new_tokens: int,
    prompt: PromptConfig = PromptConfig(),
) -> dict:
    """Load the base (and an adapter: a PEFT folder or a blob file), score it on ``task``; the dict ``hivegrpo eval
    --json`` prints."""
    from peer.model.adapter import attach_lora_for, load_adapter_bytes
    from peer.model.loading import load_base
    from peer.model.peft_folder import read_adapter

    adapter = read_adapter(adapter_path) if adapter_path is not None else None  # before the model: fail fast
    base = load_base(model_config)
    model, adapter_sha = base.model, None
    if adapter is not None:
        blob, lora = adapter
        model = attach_lora_for(model, lora, adapter_path)
        adapter_sha = load_adapter_bytes(model, blob)
        model.requires_grad_(False)
    result = exact_match(model, base.tokenizer, task, n=n, seed=seed, max_new_tokens=max_new_tokens, prompt=prompt)
    return {
        **result.to_dict(),
        "model": model_config.name,
        "quantization": model_config.quantization,
        "task": task.spec()["name"],
        "max_new_tokens": max_new_tokens,
        "prompt": prompt.to_dict(),
        "adapter": str(adapter_path) if adapter_path else None,
        "adapter_sha256": adapter_sha,
    }
