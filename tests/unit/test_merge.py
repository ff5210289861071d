"""A rollout peer's LoRA held in its base weights (peer.model.merge): the same samples as through the LoRA layers,
every version's weights computed from the kept base (no rounding carried from swap to swap), the adapter's bytes
untouched, and no merge where it would change the numbers or the copy does not fit."""

import logging
from types import SimpleNamespace

import pytest
import torch

from peer.model.adapter import adapter_to_bytes, attach_lora, load_adapter_bytes
from peer.model.config import LoRAConfig, ModelConfig
from peer.model.loading import load_base
from peer.model.memory import model_bytes
from peer.model.merge import BUFFER, MergedLoRA
from peer.model.sampling import sample_groups
from tests.helpers.models import random_lora

PROMPTS = ["123+456=", "007+045=", "999+999=", "500+250=", "1+2=", "55+5="]


def _model(quantization="nf4", dtype="float32", seed=1):
    base = load_base(ModelConfig(name="bundled", quantization=quantization, device="cpu", dtype=dtype))
    model = attach_lora(base.model, LoRAConfig())
    random_lora(model, seed)
    model.eval()
    return model, base.tokenizer


def _sample(model, tokenizer, seed=3):
    return sample_groups(
        model,
        tokenizer,
        PROMPTS,
        group_size=4,
        max_new_tokens=6,
        temperature=1.0,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(seed),
    )


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer.weight" in n}


@pytest.mark.parametrize("quantization", ["nf4", "none"])
def test_a_merged_sampler_samples_what_the_lora_layers_sample(quantization):
    model, tokenizer = _model(quantization)
    blob = adapter_to_bytes(model)
    through = _sample(model, tokenizer)
    before = model_bytes(model)
    merged = MergedLoRA.of(model)
    assert merged is not None and len(merged.layers) == 3 * 7
    assert model_bytes(model) == before + sum(layer.get_base_layer().weight.numel() * 4 for layer in merged.layers)
    assert all(layer.merged for layer in merged.layers), "peft's forward computes the base layer only"
    held = _sample(model, tokenizer)
    assert torch.equal(held.completion_ids, through.completion_ids)
    assert torch.equal(held.completion_mask, through.completion_mask)
    # float32 rounding (measured up to 5e-5 nats here); a learner's spot check allows a median of 0.05 between peers
    torch.testing.assert_close(held.logprobs, through.logprobs, rtol=0, atol=2e-4)
    assert not torch.equal(held.logprobs, through.logprobs), "it did compute otherwise (one product per layer)"
    assert adapter_to_bytes(model) == blob, "the adapter's tensors are untouched"
    assert not any(BUFFER in key for key in model.state_dict()), "the kept base is not saved with the model"


def test_every_version_is_the_kept_base_plus_its_update_with_nothing_carried_over():
    model, tokenizer = _model()
    merged = MergedLoRA.of(model)
    first, first_weights = adapter_to_bytes(model), _weights(model)
    for seed in range(20, 40):  # versions come and go; each is computed afresh from the kept base
        random_lora(model, seed)
        load_adapter_bytes(model, adapter_to_bytes(model))
        merged.refresh()
        assert not all(torch.equal(first_weights[n], w) for n, w in _weights(model).items())
    load_adapter_bytes(model, first)
    merged.refresh()
    again = _weights(model)
    assert all(torch.equal(first_weights[n], again[n]) for n in again), "bit for bit the first version's weights"
    for layer in merged.layers:
        expected = getattr(layer, BUFFER) + layer.get_delta_weight("default")
        assert torch.equal(layer.get_base_layer().weight, expected)
    unmerged, _ = _model(seed=0)
    load_adapter_bytes(unmerged, first)
    a, b = _sample(model, tokenizer), _sample(unmerged, tokenizer)
    assert torch.equal(a.completion_ids, b.completion_ids), "after 20 swaps it samples what the LoRA layers sample"
    merged.unmerge()  # back through the LoRA layers: exactly the model that never merged
    assert not any(layer.merged for layer in merged.layers)
    c = _sample(model, tokenizer)
    assert torch.equal(c.completion_ids, b.completion_ids) and torch.equal(c.logprobs, b.logprobs)


@pytest.mark.parametrize(
    "quantization, dtype, why",
    [
        ("nf4", "bfloat16", "not plain float32 Linear"),  # stays packed in bfloat16
        ("none", "bfloat16", "adding the update there would round it away"),
        ("int8", "float32", "not plain float32 Linear"),
    ],
)
def test_no_merge_where_it_would_change_the_numbers(quantization, dtype, why, caplog):
    model, _ = _model(quantization, dtype)
    with caplog.at_level(logging.INFO, logger="hivegrpo.model.merge"):
        assert MergedLoRA.of(model) is None
    assert why in caplog.text and "sampling through the LoRA layers" in caplog.text
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_no_merge_where_the_kept_base_does_not_fit(monkeypatch, caplog):
    import psutil

    model, tokenizer = _model()
    need = 3 * (4 * 128 * 128 + 3 * 128 * 512) * 4
    with caplog.at_level(logging.INFO, logger="hivegrpo.model.merge"):
        assert MergedLoRA.of(model, max_memory=2 * (model_bytes(model) + need) - 2) is None
    assert "more than half of --max-memory" in caplog.text
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * need - 4))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hivegrpo.model.merge"):
        assert MergedLoRA.of(model) is None
    assert "more than a quarter of the available" in caplog.text
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * need))
    assert MergedLoRA.of(model) is not None
