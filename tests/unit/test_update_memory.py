"""A learner's update in less memory (peer/roles/learner/update.py): micro-batches and gradient checkpointing give the
whole batch's gradient and statistics, and running out of memory halves the micro-batch tokens and redoes the step.
On the bundled model in nf4 with LoRA, groups of varied lengths, the KL term on, an adapter moved off its initial
value (so ratios leave 1, some tokens clip, the KL is not zero)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from peer.errors import UserError
from peer.roles.learner.update import (
    MicroBatcher,
    batch_tensors,
    enable_gradient_checkpointing,
    micro_batches,
    share_gradient,
)
from tests.helpers.intake import PEER_ID, SHA0, A, sample_scored

# max |micro - whole| over a tensor, relative to that tensor's largest |whole|. In fp32 on nf4 the sums' order alone
# moves it: the whole batch with its rows permuted differed by 9.6e-7, one row per micro-batch by 2.8e-5. In float64
# (the loss itself computes in float32) one row per micro-batch differed by 3.5e-8: the math is the same.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}


def _build(quantization: str, dtype: torch.dtype) -> SimpleNamespace:
    from coordinator.manifest import RunSettings, build_manifest
    from peer.model.adapter import attach_lora, lora_parameters
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.loading import bundled_path, load_base
    from peer.roles.rollout.groups import build_groups
    from peer.run.spec import run_spec

    manifest = build_manifest(RunSettings(run_id="micro"), bundled_path(), "0" * 64, PEER_ID)
    spec = run_spec(manifest, A)
    # in float32 the run's token floor is off: on this perturbed adapter it leaves out the rows' largest gradients
    # (improbable tokens), and the sums' rounding, the same in absolute terms, was then 1.6e-4 of the largest left; in
    # float64 the floor is on and the micro-batches must give the same tokens left out and the same gradient
    floor = spec.loss.token_floor if dtype == torch.float64 else 0.0
    spec = dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, kl_beta=0.1, token_floor=floor))
    base = load_base(ModelConfig(name="bundled", quantization=quantization, device="cpu"))
    model = attach_lora(base.model, LoRAConfig()).to(dtype)
    batch, rewards = sample_scored(model, base.tokenizer, spec, A, range(12), seed=3)
    groups = build_groups(batch, rewards, range(12), spec, version=0, sha=SHA0, owner=A, producer=PEER_ID)
    groups = [g for g in groups if len(set(g.rewards)) > 1]
    torch.manual_seed(5)
    with torch.no_grad():  # another adapter than the one that sampled: ratios leave 1, the KL is not zero
        for p in lora_parameters(model):
            p.add_(torch.randn_like(p) * 0.05)
    accepted = [SimpleNamespace(owner=A, group=g) for g in groups]
    packed = batch_tensors(accepted, 1, spec, base.tokenizer.pad_token_id, torch.device("cpu"))
    # the bundled task's prompts and completions all have one length: vary them as groups of other lengths would be
    # (shorter prompts are more left padding, shorter completions end earlier), keeping the layout valid
    C = packed.completion_ids.shape[1]
    for r in range(packed.prompt_ids.shape[0]):
        cut = r % 4
        packed.prompt_mask[r, :cut] = 0
        packed.prompt_ids[r, :cut] = base.tokenizer.pad_token_id
        packed.completion_mask[r, 1 + (3 * r) % C :] = False
    packed.behaviour = packed.behaviour.to(dtype)
    return SimpleNamespace(model=model, spec=spec, batch=packed, dtype=dtype)


@pytest.fixture(scope="module")
def run():
    return _build("nf4", torch.float32)


@pytest.fixture(scope="module")
def run64():
    return _build("none", torch.float64)


def _close(whole, other, dtype=torch.float32):
    assert whole.tokens == other.tokens and whole.stats["rows"] == other.stats["rows"]
    assert whole.stats["improbable"] == other.stats["improbable"]
    for name in ("loss", "clip_fraction", "ratio_mean", "ratio_max"):
        assert other.stats[name] == pytest.approx(whole.stats[name], rel=1e-5, abs=1e-7), name
    worst = 0.0
    for a, b in zip(whole.grads, other.grads, strict=True):
        worst = max(worst, float((a - b).abs().max()) / max(float(a.abs().max()), 1e-30))
    assert worst <= TOLERANCE[dtype], worst
    return worst


def test_the_batch_has_what_the_comparison_needs(run):
    b = run.batch
    rows = b.advantages.ne(0).nonzero().flatten()
    prompt, completion = b.prompt_mask[rows].sum(1), b.completion_mask[rows].sum(1)
    assert len(set((prompt + completion).tolist())) > 2, "rows of varied lengths"
    whole = share_gradient(run.model, b, run.spec)
    assert whole.stats["clip_fraction"] > 0 and whole.stats["ratio_max"] > 1.0


@pytest.mark.parametrize("tokens", [1, 40, 100, 10**6])
def test_micro_batches_give_the_whole_batchs_gradient_and_statistics(run, tokens):
    whole = share_gradient(run.model, run.batch, run.spec)
    rows = run.batch.advantages.ne(0).nonzero().flatten()
    parts = micro_batches(run.batch, rows, tokens)
    assert sorted(torch.cat(parts).tolist()) == rows.tolist(), "every row in exactly one micro-batch"
    for part in parts:
        prompt, completion = run.batch.prompt_mask[part].sum(1), run.batch.completion_mask[part].sum(1)
        assert len(part) == 1 or len(part) * int(prompt.max() + completion.max()) <= tokens
    _close(whole, share_gradient(run.model, run.batch, run.spec, micro_batch_tokens=tokens))


@pytest.mark.parametrize("tokens", [1, 40])
def test_in_float64_micro_batches_match_to_float32_rounding_of_the_loss(run64, tokens):
    whole = share_gradient(run64.model, run64.batch, run64.spec)
    assert whole.stats["improbable"] > 0, "tokens below the run's floor, left out of the loss"
    _close(whole, share_gradient(run64.model, run64.batch, run64.spec, micro_batch_tokens=tokens), torch.float64)


def test_out_of_memory_halves_the_micro_batch_tokens_redoes_the_step_and_keeps_them(run):
    whole = share_gradient(run.model, run.batch, run.spec)
    limit = 60  # tokens one forward may take before "running out of memory"
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        seen.append(ids.numel())
        if ids.numel() > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    handle = run.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        micro = MicroBatcher()
        share = micro.share_gradient(run.model, run.batch, run.spec)
        assert micro.tokens is not None and micro.tokens <= limit, "the size that worked is kept"
        _close(whole, share)
        kept = micro.tokens
        seen.clear()
        micro.share_gradient(run.model, run.batch, run.spec)
        assert max(seen) <= limit and micro.tokens == kept, "the next step starts at the kept size"
        with pytest.raises(UserError, match="out of memory at .* micro-batch tokens: one row per micro-batch"):
            longest = int((run.batch.prompt_mask.sum(1) + run.batch.completion_mask.sum(1)).max())
            limit = longest - 1
            MicroBatcher().share_gradient(run.model, run.batch, run.spec)
    finally:
        handle.remove()


def test_gradient_checkpointing_gives_the_same_gradient(run):
    whole = share_gradient(run.model, run.batch, run.spec)
    enable_gradient_checkpointing(run.model)
    try:
        assert run.model.base_model.model.model.gradient_checkpointing
        checkpointed = share_gradient(run.model, run.batch, run.spec)
        micro = share_gradient(run.model, run.batch, run.spec, micro_batch_tokens=40)
    finally:
        run.model.gradient_checkpointing_disable()
        run.model.disable_input_require_grads()
    _close(whole, checkpointed)
    _close(whole, micro)


def test_micro_batch_tokens_are_validated():
    from peer.roles.learner.peer import LearnerConfig
    from peer.roles.learner.reference import ReferenceConfig

    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        LearnerConfig(run_id="r", micro_batch_tokens=0)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        ReferenceConfig(micro_batch_tokens=-5)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        MicroBatcher(0)
