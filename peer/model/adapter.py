"""LoRA adapters: attach, serialize to/from safetensors bytes with a sha256, and hot-swap in place.

An adapter *version* travels as the safetensors bytes of its LoRA tensors (the same keys peft's
``adapter_model.safetensors`` uses), named by their sha256. Loading a version copies the tensors into the
existing LoRA parameters: no model rebuild, same storage, so an optimizer or a sampler holding the parameters
keeps working. A blob is checked (hash, exact key set, shapes, finite values) before anything is copied, so a bad
blob changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import warnings
import weakref

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from peer.errors import UserError
from peer.model.config import LoRAConfig

ADAPTER_FILE = "adapter_model.safetensors"
METADATA_KEY = "hivegrpo.lora"


class AdapterError(UserError, ValueError):
    """An adapter blob that does not fit the model or does not hash to what was announced."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def peft_lora_config(config: LoRAConfig, **extra) -> PeftLoraConfig:
    """peft's ``LoraConfig`` of ``config``: plain LoRA on a causal LM (``extra``: more of peft's fields)."""
    return PeftLoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )


def attach_lora(model, config: LoRAConfig) -> PeftModel:
    """Wrap the frozen base with a LoRA adapter whose initial weights depend only on ``config.init_seed``."""
    with warnings.catch_warnings():  # peft reads transformers' deprecated ``is_gradient_checkpointing`` once, here:
        # a FutureWarning in every peer's log that nobody running a peer can act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, peft_lora_config(config))
    initialize_lora(peft_model, config.init_seed)
    for name, param in peft_model.named_parameters():
        param.requires_grad_("lora_" in name)
    return peft_model


def attach_lora_for(model, config: LoRAConfig, source) -> PeftModel:
    """:func:`attach_lora` for an adapter a user brought (``source`` names it): AdapterError when its target modules
    are not in this model, instead of peft's ValueError."""
    try:
        return attach_lora(model, config)
    except ValueError as e:
        raise AdapterError(
            f"the adapter {source} does not fit this model ({e}); pass the model it was trained on (--model)"
        ) from None


def initialize_lora(model: PeftModel, seed: int) -> None:
    """peft's default LoRA start (A Kaiming-uniform with a = sqrt(5), B zero) drawn in float32 on the CPU from
    ``seed``, A matrices in module order, then copied to wherever the parameters live.

    peft draws A in the base model's dtype and on its device, so a bfloat16 base or a GPU would make another v0
    than the host's float32 CPU one, and the peer would refuse the run's manifest. Drawn here, v0 depends on the
    seed and the LoRA shape only.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                fan_in = param.shape[1]  # kaiming_uniform_(a=sqrt(5)): bound = sqrt(6 / ((1 + 5) * fan_in))
                bound = 1.0 / fan_in**0.5
                draw = torch.rand(param.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound
                param.copy_(draw)
            elif "lora_B" in name:
                param.zero_()


def lora_parameters(model: PeftModel) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _slots(model: PeftModel) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's file keys (those of peft's ``adapter_model.safetensors``), sorted, each with the LoRA parameter
    it names; worked out once per model, since parameters are written in place and never replaced.

    peft's own state-dict walk costs ~3 ms on the bundled model, and a hot swap needed it three times (check, load,
    re-hash): ~11 ms between two batches of a rollout peer instead of ~2.
    """
    slots = _SLOTS.get(model)
    if slots is None:
        name = model.active_adapter
        params = {n.replace(f".{name}.", "."): p for n, p in model.named_parameters() if "lora_" in n}
        keys = set(get_peft_model_state_dict(model))
        if keys != set(params):
            raise AdapterError(
                f"this model's LoRA parameters do not match its adapter keys ({sorted(keys ^ set(params))[:3]}): "
                "only one plain LoRA adapter per model is supported"
            )
        slots = _SLOTS[model] = sorted(params.items())
    return slots


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors by file key (detached views of the live parameters, not copies)."""
    return {k: p.detach() for k, p in _slots(model)}


def lora_config_of(model: PeftModel) -> LoRAConfig:
    c = model.peft_config["default"]
    return LoRAConfig(
        r=c.r, alpha=c.lora_alpha, dropout=c.lora_dropout, target_modules=tuple(sorted(c.target_modules))
    )


def adapter_to_bytes(model: PeftModel) -> bytes:
    """The adapter's tensors as safetensors bytes (fp32, CPU, deterministic for equal weights).

    The LoRA shape (r, alpha, target modules) rides along as safetensors metadata so a file alone is enough to
    rebuild the adapter on a fresh base (``hivegrpo eval --adapter FILE``).
    """
    tensors = {k: v.to("cpu", torch.float32).contiguous() for k, v in adapter_state(model).items()}
    lora = lora_config_of(model).to_dict()
    lora.pop("init_seed")
    return st_save(tensors, metadata={METADATA_KEY: json.dumps(lora, sort_keys=True)})


def blob_lora_config(blob: bytes) -> LoRAConfig:
    """The LoRA configuration an adapter blob was saved with (from its metadata)."""
    try:
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        return LoRAConfig.from_dict(json.loads(header["__metadata__"][METADATA_KEY]))
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterError(
            f"adapter file carries no readable LoRA configuration ({e}); pass the PEFT adapter folder it came "
            "from instead"
        ) from e


def parse_adapter(model: PeftModel, blob: bytes, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Decode and check a blob against ``model``'s adapter layout; raises AdapterError, changes nothing."""
    if expected_sha256 is not None and sha256_hex(blob) != expected_sha256:
        raise AdapterError(
            f"adapter blob hashes to {sha256_hex(blob)[:12]}…, not the announced {expected_sha256[:12]}…; "
            "it is corrupt or not the announced version: fetch it again from another provider"
        )
    try:
        tensors = st_load(blob)
    except Exception as e:  # safetensors raises several types on junk
        raise AdapterError(f"adapter blob is not valid safetensors ({e}); fetch it again") from e
    expected = {k: v.shape for k, v in adapter_state(model).items()}
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise AdapterError(
            f"adapter does not fit this model (missing {missing[:3]}, unexpected {extra[:3]}): "
            "it was made for another base model or LoRA configuration"
        )
    for key, shape in expected.items():
        t = tensors[key]
        if t.shape != shape:
            raise AdapterError(f"adapter tensor {key} has shape {tuple(t.shape)}, the model needs {tuple(shape)}")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise AdapterError(f"adapter tensor {key} holds non-finite or non-float values; refusing to load it")
    return tensors


def load_adapter_bytes(model: PeftModel, blob: bytes, expected_sha256: str | None = None) -> str:
    """Hot-swap the adapter weights in place from ``blob``; returns its sha256."""
    tensors = parse_adapter(model, blob, expected_sha256)
    with torch.no_grad():  # into the same storage: an optimizer or a sampler holding the parameters keeps working
        for key, param in _slots(model):
            param.copy_(tensors[key])
    return sha256_hex(blob)
