"""The CUDA paths, on a machine with a GPU (skipped elsewhere; `bash .ci/gpu` runs them with the GPU benchmarks).

nf4 and int8 bases load onto the GPU and train LoRA; the decode loop samples with its KV cache there, reproducibly,
recording log-probs its own forward pass agrees with; a learner step in micro-batches gives the whole batch's
gradient; a real CUDA out-of-memory error halves the batch; a GPU peer sampling in bfloat16 passes a float32 CPU
learner's spot check.
"""

import pytest
import torch

from peer.model.adapter import attach_lora, lora_parameters
from peer.model.config import LoRAConfig, ModelConfig
from peer.model.loading import load_base
from tests.helpers.intake import sample_scored

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["123+456=", "007+045=", "999+999=", "500+250="]


def _gpu_model(quantization: str, dtype: str = "auto"):
    base = load_base(ModelConfig(name="bundled", quantization=quantization, device="cuda", dtype=dtype))
    return base, attach_lora(base.model, LoRAConfig())


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_base_loads_on_the_gpu_and_trains_lora_only(quantization):
    import bitsandbytes as bnb

    base, model = _gpu_model(quantization)
    assert base.device.type == "cuda" and base.dtype == (
        torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    )
    kind = bnb.nn.Linear4bit if quantization == "nf4" else bnb.nn.Linear8bitLt
    layers = [m for m in model.modules() if isinstance(m, kind)]
    assert layers and all(m.weight.device.type == "cuda" for m in layers)
    from peer.model.sampling import encode_prompts

    ids, mask = encode_prompts(base.tokenizer, [p + "0000" for p in PROMPTS], base.device)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora_parameters(model))
    assert [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n] == []


def test_sampling_on_the_gpu_is_reproducible_and_its_logprobs_match_a_forward_pass():
    from peer.grpo import completion_logprobs
    from peer.model.sampling import sample_groups

    base, model = _gpu_model("nf4")

    def sample(seed: int):
        return sample_groups(
            model,
            base.tokenizer,
            PROMPTS,
            group_size=4,
            max_new_tokens=8,
            temperature=1.0,
            device=base.device,
            generator=torch.Generator(device=base.device).manual_seed(seed),
        )

    batch, again = sample(0), sample(0)
    assert torch.equal(batch.completion_ids, again.completion_ids)
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, 1.0)
    mask = batch.completion_mask
    # the same GPU and dtype, one forward for all positions instead of one per step: rounding only
    assert (recomputed[mask] - batch.logprobs[mask]).abs().max() < 0.05


def test_a_micro_batched_step_on_the_gpu_gives_the_whole_batchs_gradient():
    from types import SimpleNamespace

    from peer.roles.learner.update import batch_tensors, share_gradient
    from peer.roles.rollout.groups import build_groups
    from tests.benchmarks import verification as bench

    spec = bench.run_spec()
    base, model = _gpu_model("nf4", dtype="float32")
    batch, rewards = sample_scored(model, base.tokenizer, spec, bench.OWNER, range(16), seed=1, device=base.device)
    groups = build_groups(batch, rewards, range(16), spec, version=0, sha=bench.SHA, owner=bench.OWNER,
                          producer=bench.PEER_ID)  # fmt: skip
    groups = [g for g in groups if len(set(g.rewards)) > 1]
    assert groups, "no group with signal to learn from"
    with torch.no_grad():  # off the sampling adapter: ratios leave 1
        for p in lora_parameters(model):
            p.add_(torch.randn_like(p) * 0.05)
    accepted = [SimpleNamespace(owner=bench.OWNER, group=g) for g in groups]
    packed = batch_tensors(accepted, 1, spec, base.tokenizer.pad_token_id, base.device)
    whole = share_gradient(model, packed, spec)
    parts = share_gradient(model, packed, spec, micro_batch_tokens=40)
    for a, b in zip(whole.grads, parts.grads, strict=True):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-8  # summation order only, as on the CPU


def test_a_real_cuda_out_of_memory_halves_the_batch():
    from peer.model.memory import in_batches

    free, _ = torch.cuda.mem_get_info()
    per_item = free // 6  # 4 items fit, 8 do not

    def work(start: int, stop: int) -> list[int]:
        block = torch.empty(per_item * (stop - start), dtype=torch.uint8, device="cuda")
        del block
        return list(range(start, stop))

    done, size = in_batches(work, 16, 16, what="items")
    assert [i for chunk in done for i in chunk] == list(range(16)) and size <= 4


def test_a_bfloat16_gpu_peer_passes_a_float32_cpu_learners_spot_check():
    from peer.model.sampling import sample_groups
    from peer.roles.learner.verify import check_logprobs_many
    from peer.roles.rollout.groups import build_groups
    from tests.benchmarks import verification as bench

    spec = bench.run_spec()
    versions = bench.train_versions(spec, 4)
    verifier, tokenizer = bench.load_model("float32", spec.lora)
    bench.set_lora(verifier, versions[-1])
    base, sampler = _gpu_model("nf4", dtype="bfloat16")
    bench.set_lora(sampler, [t.to("cuda") for t in versions[-1]])
    s = spec.sampling
    seqs = range(128)
    examples = [spec.example(bench.OWNER, seq) for seq in seqs]
    batch = sample_groups(
        sampler,
        base.tokenizer,
        [e.prompt for e in examples],
        group_size=s.group_size,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        device=base.device,
        generator=torch.Generator(device="cuda").manual_seed(0),
    )
    texts = batch.texts(base.tokenizer)
    rewards = [spec.task.reward(t, examples[i // s.group_size]) for i, t in enumerate(texts)]
    groups = build_groups(
        batch, rewards, seqs, spec, version=0, sha=bench.SHA, owner=bench.OWNER, producer=bench.PEER_ID
    )
    refused = []
    for i in range(0, len(groups), bench.CHUNK):
        refused += [str(r) for r in check_logprobs_many(verifier, groups[i : i + bench.CHUNK], spec) if r]
    assert refused == [], refused[:3]
