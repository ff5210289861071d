"""Build the bundled tiny base model (provenance of ``peer/model/bundled``; run ``hivegrpo build-tiny``).

Recipe: the 16-token character tokenizer, a 3-layer ``LlamaForCausalLM`` (hidden 128, MLP 512, 4 heads, tied
embeddings, ~0.79M parameters), supervised warm-up on zero-padded 3-digit addition (``abc+def=`` → the 4-digit
sum then ``<eos>``; loss on answer tokens only, batch 128, AdamW lr 3e-3). The warm-up is stopped in the middle of
its sharp transition, when greedy exact match on the held-out set is about 0.30 *for the nf4-quantized model
peers actually run*, so GRPO has room to show learning and every group has a mix of right and wrong answers.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peer.log import get_logger
from peer.model.config import ModelConfig
from peer.model.evaluate import exact_match
from peer.model.loading import load_base
from peer.model.tokenizer import build_char_tokenizer
from peer.tasks import get_task

logger = get_logger(__name__)


def tiny_config(tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def _sft_batch(task, tokenizer, seed: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    examples = [task.example(seed, start + i) for i in range(size)]
    prompts = tokenizer([e.prompt for e in examples], add_special_tokens=True)["input_ids"]
    answers = tokenizer([e.reference for e in examples], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers, strict=True)])
    labels = ids.clone()
    labels[:, : len(prompts[0])] = -100  # all prompts have the same length; learn the answer only
    return ids, labels


def _nf4_exact_match(model, tokenizer, task, n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        base = load_base(ModelConfig(name=tmp, quantization="nf4", device="cpu"))
        return exact_match(base.model, base.tokenizer, task, n=n).exact_match


def build(
    out_dir: Path,
    *,
    target: float = 0.30,
    tolerance: float = 0.03,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 3e-3,
    max_steps: int = 3000,
    eval_n: int = 500,
) -> dict:
    """Train and save the bundled model into ``out_dir``; returns the build record (also saved as build.json)."""
    torch.manual_seed(seed)
    task = get_task("addition")
    tokenizer = build_char_tokenizer()
    model = LlamaForCausalLM(tiny_config(tokenizer))
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    start = time.perf_counter()
    best = None
    for step in range(1, max_steps + 1):
        ids, labels = _sft_batch(task, tokenizer, seed, step * batch_size, batch_size)
        model.train()
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % 10:
            continue
        em = exact_match(model, tokenizer, task, n=eval_n).exact_match
        logger.info("step %d loss %.3f fp32 exact match %.3f", step, loss.item(), em)
        if em < target - 0.15:
            continue
        em_nf4 = _nf4_exact_match(model, tokenizer, task, eval_n)
        logger.info("step %d nf4 exact match %.3f", step, em_nf4)
        if best is None or abs(em_nf4 - target) < abs(best[1] - target):
            best = (step, em_nf4, em, {k: v.clone() for k, v in model.state_dict().items()})
        if abs(em_nf4 - target) <= tolerance or em_nf4 > target + tolerance:
            break
    if best is None:
        raise RuntimeError(f"warm-up never reached exact match {target} in {max_steps} steps")
    step, em_nf4, em, state = best
    model.load_state_dict(state)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record = {
        "sft_step": step,
        "exact_match_nf4": em_nf4,
        "exact_match_fp32": em,
        "eval_n": eval_n,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
    }
    (out_dir / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    from peer.log import configure

    configure()
    torch.set_num_threads(1)
    print(json.dumps(build(Path(__file__).parent / "bundled"), indent=2))
