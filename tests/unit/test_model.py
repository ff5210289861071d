"""The base model and adapters: bundled model, nf4/int8 quantization, LoRA gradients, hot-swap, sampling."""

import pytest
import torch

from peer.grpo import completion_logprobs
from peer.model.adapter import (
    AdapterError,
    adapter_to_bytes,
    attach_lora,
    blob_lora_config,
    load_adapter_bytes,
    lora_parameters,
    sha256_hex,
)
from peer.model.config import LoRAConfig, ModelConfig
from peer.model.loading import ModelLoadError, load_base
from peer.model.sampling import encode_prompts, sample_groups
from tests.helpers.models import random_lora

PROMPTS = ["123+456=", "007+045=", "999+999=", "500+250="]


def _base(quantization, unpack=True):
    return load_base(ModelConfig(name="bundled", quantization=quantization, device="cpu"), unpack=unpack)


def _lora_model(quantization, seed=0, unpack=True):
    base = _base(quantization, unpack)
    return attach_lora(base.model, LoRAConfig(init_seed=seed)), base.tokenizer


def _sft_loss(model, tokenizer):
    ids, mask = encode_prompts(tokenizer, [p + "0000" for p in PROMPTS], torch.device("cpu"))
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _lora_grads(model, tokenizer):
    model.zero_grad(set_to_none=True)
    model.train()
    _sft_loss(model, tokenizer).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def test_bundled_is_the_documented_tiny_llama():
    base = _base("none")
    cfg = base.model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 512, 3, 4)
    assert cfg.tie_word_embeddings and len(base.tokenizer) == cfg.vocab_size == 16
    assert 0.7e6 < sum(p.numel() for p in base.model.parameters()) < 0.85e6
    tokens = base.tokenizer.convert_ids_to_tokens(base.tokenizer("12+3=")["input_ids"])
    assert tokens == ["<bos>", "1", "2", "+", "3", "="]


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_base_is_really_quantized(quantization):
    import bitsandbytes as bnb

    base = _base(quantization, unpack=False)
    layer_type = bnb.nn.Linear4bit if quantization == "nf4" else bnb.nn.Linear8bitLt
    layers = [m for m in base.model.modules() if isinstance(m, layer_type)]
    assert len(layers) == 3 * 7  # every attention and MLP projection
    assert not any(p.requires_grad for p in base.model.parameters())


@pytest.mark.parametrize("quantization", ["nf4", "int8", "none"])
def test_generate_then_train_changes_lora_only(quantization):
    model, tokenizer = _lora_model(quantization)
    batch = sample_groups(
        model, tokenizer, PROMPTS, group_size=4, max_new_tokens=6, temperature=1.0, device=torch.device("cpu")
    )
    assert batch.completion_ids.shape[0] == 16 and batch.completion_mask.any()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model.train()
        _sft_loss(model, tokenizer).backward()
        optimizer.step()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items()), "a base weight changed"
    assert all(not torch.equal(after[n], v) for n, v in lora_before.items()), "a LoRA weight did not change"


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_lora_gradients_after_generate_equal_a_fresh_model(quantization):
    fresh, tokenizer = _lora_model(quantization, unpack=False)
    used, _ = _lora_model(quantization, unpack=False)
    random_lora(fresh)
    random_lora(used)
    used.eval()
    with torch.no_grad():  # the inference path that, unchecked, repacks 4-bit weights for good
        sample_groups(
            used, tokenizer, PROMPTS, group_size=2, max_new_tokens=6, temperature=1.0, device=torch.device("cpu")
        )
        used(**tokenizer(PROMPTS, return_tensors="pt", padding=True))
    g_fresh, g_used = _lora_grads(fresh, tokenizer), _lora_grads(used, tokenizer)
    assert set(g_fresh) == set(g_used) and len(g_fresh) == 3 * 7 * 2
    for name in g_fresh:
        assert g_fresh[name].abs().sum() > 0, name
        torch.testing.assert_close(g_used[name], g_fresh[name], rtol=1e-4, atol=1e-6, msg=name)


def test_adapter_bytes_round_trip_hot_swap_in_place():
    src, tokenizer = _lora_model("nf4")
    random_lora(src, seed=3)
    blob = adapter_to_bytes(src)
    assert adapter_to_bytes(src) == blob, "serialization is not deterministic"
    assert blob_lora_config(blob).r == 8
    dst, _ = _lora_model("nf4")
    storage = [p.data_ptr() for p in lora_parameters(dst)]
    assert load_adapter_bytes(dst, blob, expected_sha256=sha256_hex(blob)) == sha256_hex(blob)
    assert storage == [p.data_ptr() for p in lora_parameters(dst)], "hot-swap must not reallocate parameters"
    ids = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    src.eval()
    dst.eval()
    with torch.no_grad():
        assert torch.equal(src(**ids).logits, dst(**ids).logits)
    assert adapter_to_bytes(dst) == blob


def test_adapter_bytes_follow_in_place_updates_and_peft_layout():
    """The key-to-parameter map is worked out once per model: it must keep reading the live parameters after an
    optimizer step, and write exactly the tensors under exactly the keys peft's own state dict has."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load as st_load

    model, tokenizer = _lora_model("none")
    before = adapter_to_bytes(model)
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    model(**tokenizer(PROMPTS, return_tensors="pt", padding=True)).logits.float().pow(2).mean().backward()
    optimizer.step()
    after = adapter_to_bytes(model)
    assert after != before, "the serialized adapter did not follow the optimizer's in-place step"
    peft_state = get_peft_model_state_dict(model)
    written = st_load(after)
    assert set(written) == set(peft_state)
    for key, tensor in peft_state.items():
        assert torch.equal(written[key], tensor.float()), key


def test_bad_adapter_blobs_are_refused_and_change_nothing():
    model, _ = _lora_model("none")
    random_lora(model, seed=5)
    good = adapter_to_bytes(model)
    before = adapter_to_bytes(model)
    other = attach_lora(_base("none").model, LoRAConfig(r=4))
    wrong_shape = adapter_to_bytes(other)
    flipped = bytearray(good)
    flipped[-10] ^= 0xFF
    with pytest.raises(AdapterError, match="hashes to"):
        load_adapter_bytes(model, bytes(flipped), expected_sha256=sha256_hex(good))
    with pytest.raises(AdapterError, match="not valid safetensors"):
        load_adapter_bytes(model, good[: len(good) // 2])
    with pytest.raises(AdapterError, match="shape"):
        load_adapter_bytes(model, wrong_shape)
    nan_model, _ = _lora_model("none")
    with torch.no_grad():
        lora_parameters(nan_model)[0].fill_(float("nan"))
    with pytest.raises(AdapterError, match="non-finite"):
        load_adapter_bytes(model, adapter_to_bytes(nan_model))
    assert adapter_to_bytes(model) == before


@pytest.mark.parametrize("quantization", ["nf4", "none"])
def test_behaviour_logprobs_match_recomputation(quantization):
    model, tokenizer = _lora_model(quantization)
    random_lora(model, seed=7)
    model.eval()
    prompts = ["1+2=", "123+456=", "55+5="]  # different lengths: left padding
    gen = torch.Generator().manual_seed(0)
    batch = sample_groups(
        model,
        tokenizer,
        prompts,
        group_size=4,
        max_new_tokens=6,
        temperature=0.7,
        device=torch.device("cpu"),
        generator=gen,
    )
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, 0.7)
    mask = batch.completion_mask
    torch.testing.assert_close(recomputed[mask], batch.logprobs[mask], rtol=0, atol=2e-4)
    again = sample_groups(
        model,
        tokenizer,
        prompts,
        group_size=4,
        max_new_tokens=6,
        temperature=0.7,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(again.completion_ids, batch.completion_ids), "sampling is not reproducible from its seed"


def test_missing_model_gives_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_base(ModelConfig(name=str(tmp_path / "empty"), quantization="none", device="cpu"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="fp3")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_compute_dtype_runs_on_cpu_with_the_same_adapter_bytes(dtype):
    """``--dtype`` is a peer's own choice: the base computes in it (on CPU too), the LoRA stays float32, so the
    adapter a 16-bit peer holds serializes to the same bytes (and sha256) as a float32 peer's."""
    base = load_base(ModelConfig(name="bundled", quantization="nf4", device="cpu", dtype=dtype))
    assert base.dtype == getattr(torch, dtype)
    model = attach_lora(base.model, LoRAConfig())
    assert {p.dtype for p in lora_parameters(model)} == {torch.float32}
    ids, mask = encode_prompts(base.tokenizer, PROMPTS, torch.device("cpu"))
    assert model(input_ids=ids, attention_mask=mask).logits.dtype == getattr(torch, dtype)
    reference, _ = _lora_model("nf4")
    assert adapter_to_bytes(model) == adapter_to_bytes(reference)


def test_device_and_dtype_are_checked_with_one_clear_error():
    from peer.model.config import check_device
    from peer.model.loading import resolve_device, resolve_dtype

    assert [check_device(d) for d in ("auto", "cpu", "cuda", "cuda:0", "cuda:12")] == [
        "auto",
        "cpu",
        "cuda",
        "cuda:0",
        "cuda:12",
    ]
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "mps:0"):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            ModelConfig(device=bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="fp8")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="sees no CUDA device; use --device cpu or auto"):
            resolve_device("cuda:1")
        assert resolve_device("auto") == torch.device("cpu")


def test_importing_the_model_code_logs_no_failed_optional_kernel():
    """bitsandbytes logs "Failed to load CPU gemm_4bit_forward" at its import on AVX512-BF16 CPUs when transformers
    brings the ``kernels`` package (it refuses the hub's kernel): ``peer`` drops that one line, nothing else."""
    import subprocess
    import sys

    code = (
        "import logging, peer.model.loading, bitsandbytes\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('Failed to load CPU gemm_4bit_forward: x')\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('another warning')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gemm_4bit_forward" not in done.stderr and "another warning" in done.stderr, done.stderr[-2000:]


def _grads_logits_and_samples(model, tokenizer):
    random_lora(model, seed=11)
    grads = _lora_grads(model, tokenizer)
    model.eval()
    with torch.no_grad():
        logits = model(**tokenizer(PROMPTS, return_tensors="pt", padding=True)).logits
    batch = sample_groups(
        model,
        tokenizer,
        PROMPTS,
        group_size=4,
        max_new_tokens=6,
        temperature=1.0,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(2),
    )
    return grads, logits, batch


def test_an_nf4_base_computing_in_float32_on_cpu_is_unpacked_once_to_the_same_numbers():
    """On CPU a ``Linear4bit`` de-quantizes its weight at every forward; an unpacked base holds those float32
    values from the start, so the log-probs, samples and LoRA gradients are the packed base's, bit for bit."""
    import bitsandbytes as bnb

    packed, unpacked = _base("nf4", unpack=False), _base("nf4")
    assert (packed.unpacked, unpacked.unpacked) == (False, True)
    assert unpacked.quantization == "nf4", "the run's quantization is what the weights' values are"
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in unpacked.model.modules())
    assert getattr(unpacked.model.config, "quantization_config", None) is None
    assert not any(p.requires_grad for p in unpacked.model.parameters())
    layers = {n: m for n, m in packed.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 3 * 7
    for name, layer in layers.items():
        plain = unpacked.model.get_submodule(name)
        assert type(plain) is torch.nn.Linear and plain.weight.dtype == torch.float32, name
        assert torch.equal(plain.weight, bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state))
    a = attach_lora(packed.model, LoRAConfig())
    b = attach_lora(unpacked.model, LoRAConfig())
    assert adapter_to_bytes(a) == adapter_to_bytes(b), "the adapter's layout does not depend on how the base is held"
    (ga, la, sa), (gb, lb, sb) = (
        _grads_logits_and_samples(a, packed.tokenizer),
        _grads_logits_and_samples(b, unpacked.tokenizer),
    )
    assert set(ga) == set(gb) and len(ga) == 3 * 7 * 2
    assert all(torch.equal(ga[n], gb[n]) for n in ga), "a LoRA gradient differs"
    assert torch.equal(la, lb), "the logits differ"
    assert torch.equal(sa.completion_ids, sb.completion_ids) and torch.equal(sa.logprobs, sb.logprobs)


@pytest.mark.parametrize(
    "quantization, dtype, unpack", [("nf4", "bfloat16", True), ("int8", "float32", True), ("nf4", "float32", False)]
)
def test_a_base_stays_packed_where_unpacking_would_change_its_numbers_or_is_declined(quantization, dtype, unpack):
    """bitsandbytes' bfloat16 and int8 CPU paths round differently from a float32 matmul: those stay as they are."""
    config = ModelConfig(name="bundled", quantization=quantization, device="cpu", dtype=dtype)
    base = load_base(config, unpack=unpack)
    assert not base.unpacked
    assert any(type(m).__module__.startswith("bitsandbytes") for m in base.model.modules())


def test_a_base_stays_packed_when_the_float32_copy_would_not_fit(monkeypatch, caplog):
    """With --max-memory the unpacked model may take half of it; without, the copy a quarter of the available RAM.
    Either way a base that does not fit loads packed, says why, and works."""
    import logging
    from types import SimpleNamespace

    import psutil

    from peer.model.loading import unpack_bytes

    config = ModelConfig(name="bundled", quantization="nf4", device="cpu")
    need = unpack_bytes(_base("nf4", unpack=False).model)
    assert need == 3 * (4 * 128 * 128 + 3 * 128 * 512) * 4
    assert load_base(config, max_memory=64 * 2**20).unpacked
    with caplog.at_level(logging.INFO, logger="hivegrpo.model.loading"):
        tight = load_base(config, max_memory=2 * need)
    assert not tight.unpacked and "more than half of --max-memory" in caplog.text
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * need - 4))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hivegrpo.model.loading"):
        short = load_base(config)
    assert not short.unpacked and "more than a quarter of the available" in caplog.text
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * need))
    assert load_base(config).unpacked
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real)
    model = attach_lora(short.model, LoRAConfig())
    assert _sft_loss(model, short.tokenizer).isfinite()
