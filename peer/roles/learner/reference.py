"""The synchronous single-process GRPO reference loop: the baseline every swarm result is compared with.

One process does what the swarm splits across peers, strictly in turn: sample ``prompts_per_step`` prompts x G
completions with the current adapter, score them with the task reward, compute group advantages, and take one
clipped-loss step against the behaviour log-probs recorded while sampling. Nothing is stale here (tau = 0 always),
so the ratio starts at 1 and the loss is the plain GRPO policy gradient; the swarm's learners use the very same
functions with older groups. Held-out exact match is measured every ``eval_every`` seconds of *training* time
(the evaluation's own time is not counted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from peer.grpo import LossConfig, SamplingConfig, group_advantages
from peer.grpo.config import PromptConfig
from peer.log import get_logger
from peer.model.adapter import adapter_to_bytes, attach_lora, lora_parameters, sha256_hex
from peer.model.config import LoRAConfig, ModelConfig
from peer.model.evaluate import exact_match
from peer.model.loading import load_base
from peer.model.sampling import sample_run
from peer.roles.learner.update import Batch, MicroBatcher, apply_gradient, enable_gradient_checkpointing
from peer.tasks import derive_seed, get_task

logger = get_logger(__name__)


@dataclass(frozen=True)
class ReferenceConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)  # chat template, system prompt, stop strings
    loss: LossConfig = field(default_factory=LossConfig)
    task: str = "addition"
    task_config: dict = field(default_factory=dict)
    prompts_per_step: int = 16
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    duration: float = 300.0  # seconds of training time
    max_steps: int | None = None
    target: float | None = None  # stop once held-out exact match reaches this
    eval_every: float = 15.0  # seconds of training time between evaluations
    eval_n: int = 500
    seed: int = 0
    report: str | None = None
    save_adapter: str | None = None
    micro_batch_tokens: int | None = None  # tokens per forward/backward (the same update); None: the whole batch
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time

    def __post_init__(self):
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"micro_batch_tokens must be >= 1 (or None: the whole batch), got {self.micro_batch_tokens}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")

    @classmethod
    def build(
        cls, *, model, quantization, device, group_size, dtype="auto", max_new_tokens=6, **options
    ) -> ReferenceConfig:
        return cls(
            model=ModelConfig(name=model, quantization=quantization, device=device, dtype=dtype),
            sampling=SamplingConfig(group_size=group_size, max_new_tokens=max_new_tokens),
            **options,
        )


def grpo_step(
    model, tokenizer, task, examples, config: ReferenceConfig, optimizer, generator, device, micro=None
) -> dict:
    """Sample, score and learn from one batch of prompts; returns the step's metrics. The gradient is the swarm
    learner's (:class:`~peer.roles.learner.update.MicroBatcher`, ``micro``: in micro-batches, backing off on
    memory)."""
    s = config.sampling
    model.eval()
    batch = sample_run(
        model, tokenizer, [e.prompt for e in examples], s, config.prompt, device=device, generator=generator
    )
    texts = batch.texts(tokenizer, config.prompt.stop)
    rewards = torch.tensor(
        [task.reward(t, examples[i // s.group_size]) for i, t in enumerate(texts)], dtype=torch.float32
    ).view(len(examples), s.group_size)
    advantages = group_advantages(rewards, config.loss.adv_eps).flatten().to(device)
    rows = advantages.ne(0).nonzero().flatten()  # groups whose rewards are all equal carry no signal
    metrics = {"reward_mean": rewards.mean().item(), "rows": int(rows.numel()), "loss": 0.0, "clip_fraction": 0.0}
    if rows.numel() == 0:
        return metrics
    on_policy = Batch(  # nothing is stale here: every weight is 1
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        batch.logprobs,
        advantages,
        torch.ones_like(advantages),
        rewards,
    )
    share = (micro or MicroBatcher(config.micro_batch_tokens)).share_gradient(model, on_policy, config)
    apply_gradient(model, optimizer, share.grads, config.max_grad_norm)
    metrics.update(loss=share.stats["loss"], clip_fraction=share.stats["clip_fraction"])
    return metrics


def run_reference(config: ReferenceConfig) -> dict:
    """Train for ``config.duration`` seconds (or steps / target); returns the curve and the final result."""
    torch.manual_seed(config.seed)
    task = get_task(config.task, config.task_config)
    base = load_base(config.model)
    model = attach_lora(base.model, config.lora)
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=config.lr)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    micro = MicroBatcher(config.micro_batch_tokens)  # halves (and keeps) its tokens when memory runs out
    generator = torch.Generator(device=base.device)
    max_new = config.sampling.max_new_tokens

    def evaluate(step: int, seconds: float, reward: float | None) -> dict:
        result = exact_match(
            model, base.tokenizer, task, n=config.eval_n, max_new_tokens=max_new, prompt=config.prompt
        )
        point = {"step": step, "seconds": round(seconds, 2), "exact_match": result.exact_match, "reward_mean": reward}
        logger.info("%.1fs step %d exact match %.3f", seconds, step, result.exact_match)
        return point

    curve = [evaluate(0, 0.0, None)]
    trained, step, next_eval, rewards = 0.0, 0, config.eval_every, []
    while trained < config.duration and (config.max_steps is None or step < config.max_steps):
        generator.manual_seed(derive_seed(config.seed, "reference-sampling", step))
        first = step * config.prompts_per_step
        examples = [task.example(config.seed, first + i) for i in range(config.prompts_per_step)]
        start = time.perf_counter()
        metrics = grpo_step(model, base.tokenizer, task, examples, config, optimizer, generator, base.device, micro)
        trained += time.perf_counter() - start
        step += 1
        rewards.append(metrics["reward_mean"])
        if trained >= next_eval:
            curve.append(evaluate(step, trained, sum(rewards) / len(rewards)))
            rewards, next_eval = [], next_eval + config.eval_every
            if config.target is not None and curve[-1]["exact_match"] >= config.target:
                break
    if curve[-1]["step"] != step:
        curve.append(evaluate(step, trained, sum(rewards) / len(rewards) if rewards else None))
    blob = adapter_to_bytes(model)
    if config.save_adapter:
        from peer.model.peft_folder import base_model_name, write_peft_folder

        write_peft_folder(config.save_adapter, blob, base_model_name(config.model.name))
    result = {
        "final_exact_match": curve[-1]["exact_match"],
        "steps": step,
        "train_seconds": round(trained, 2),
        "steps_per_second": round(step / trained, 3) if trained else 0.0,
        "curve": curve,
        "first_seconds_to": {
            str(t): next((p["seconds"] for p in curve if p["exact_match"] >= t), None) for t in (0.55, 0.8, 0.9)
        },
        "adapter_sha256": sha256_hex(blob),
        "adapter": config.save_adapter,
        "config": {
            "model": config.model.to_dict(),
            "lora": config.lora.to_dict(),
            "sampling": config.sampling.to_dict(),
            "prompt": config.prompt.to_dict(),
            "loss": config.loss.to_dict(),
            "task": task.spec(),
            "prompts_per_step": config.prompts_per_step,
            "lr": config.lr,
            "seed": config.seed,
            "threads": torch.get_num_threads(),
        },
    }
    if config.report:
        import json

        with open(config.report, "w") as f:
            json.dump(result, f, indent=2)
    return result


__all__ = ["ReferenceConfig", "grpo_step", "run_reference"]
