"""Adapters as standard PEFT folders, and every adapter a user may hand to hivegrpo.

On the wire an adapter version is one safetensors blob (:mod:`peer.model.adapter`): peft's own tensor keys, float32,
with the LoRA shape in the file's metadata, named by its sha256. What a user keeps is a PEFT folder, the layout
``PeftModel.from_pretrained(base, DIR)`` and transformers' ``model.load_adapter(DIR)`` read:

``DIR/adapter_config.json``        peft's ``LoraConfig`` (r, alpha, dropout, target modules, the base model's name)
``DIR/adapter_model.safetensors``  the wire blob itself, byte for byte (so its sha256 is the version's)

Every adapter hivegrpo writes is such a folder (``train-local --save-adapter``, the demo's result, a learner's
checkpoint, ``hivegrpo export``). :func:`read_adapter` takes any of them back, and also a PEFT folder plain peft
code wrote (any r, alpha and target modules; tensors in any float dtype become float32), a bare blob file, or a
checkpoint written before checkpoints were PEFT folders. The conversion is exact both ways: a folder written from
a blob reads back as the same bytes, and a peft-written folder's tensors load unchanged.

What hivegrpo cannot run is refused by name, before any model loads: other PEFT methods, DoRA, rank-stabilised
scaling, per-layer rank or alpha patterns, trained biases or extra saved modules, a regex of target modules, and
``adapter_model.bin`` (a pickle: loading one would run its code).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from peer.model.adapter import ADAPTER_FILE, METADATA_KEY, AdapterError, blob_lora_config, peft_lora_config
from peer.model.config import LoRAConfig

CONFIG_FILE = "adapter_config.json"
OLD_CHECKPOINT_FILE = "adapter.safetensors"  # checkpoints written before they were PEFT folders
MAX_CONFIG_BYTES = 1 << 20
MAX_ADAPTER_BYTES = 16 << 30

# peft LoraConfig fields whose non-default values change what the adapter computes: hivegrpo runs plain LoRA only.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None,),
    "layer_replication": (None,),
    "trainable_token_indices": (None,),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
}


def base_model_name(name: str) -> str:
    """How a PEFT folder names the base of model ``name`` (a ``--model`` value or a manifest's): the hub id, or the
    model folder's absolute path ('bundled' included), so ``AutoPeftModelForCausalLM`` finds it on this machine."""
    from peer.model.loading import ModelLoadError, resolve_source

    try:
        source = resolve_source(name)
    except ModelLoadError:  # a folder on the host's machine, not this one: its name is all there is
        return name
    return str(Path(source).resolve()) if Path(source).exists() else source


def peft_config_dict(lora: LoRAConfig, base_model: str) -> dict:
    """``adapter_config.json`` for ``lora`` on ``base_model`` (a hub id or a model folder), as this peft writes it."""
    config = peft_lora_config(lora, base_model_name_or_path=base_model, inference_mode=True)
    return config.to_dict() | {"target_modules": sorted(lora.target_modules)}  # peft keeps a set: fix the order


def write_peft_folder(directory: str | Path, blob: bytes, base_model: str) -> Path:
    """Write adapter ``blob`` (a wire blob) as a PEFT folder at ``directory``; the weights file is ``blob`` itself.

    Each file is written beside its final name and renamed into place, so a crash leaves the old file or the new.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise AdapterError(f"{directory} is a file; an adapter is saved as a PEFT folder: pass a folder's path")
    directory.mkdir(parents=True, exist_ok=True)
    config = peft_config_dict(blob_lora_config(blob), base_model)
    _write_atomic(directory / ADAPTER_FILE, blob)
    _write_atomic(directory / CONFIG_FILE, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return directory


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def lora_of_peft_config(config: dict, where: Path) -> LoRAConfig:
    """The plain LoRA shape a PEFT ``adapter_config.json`` describes; AdapterError naming what hivegrpo can't run."""
    if not isinstance(config, dict):
        raise AdapterError(f"{where} is not a JSON object: it is not a PEFT adapter config")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where} is a {config.get('peft_type')} adapter; hivegrpo runs LoRA adapters only")
    for name, plain in _UNSUPPORTED.items():
        if name in config and config[name] not in plain:
            raise AdapterError(
                f"{where} sets {name}={config[name]!r}, which hivegrpo does not run (plain LoRA only); "
                f"train or save the adapter with {name}={plain[0]!r}"
            )
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise AdapterError(
            f"{where} names its target modules by the pattern {targets!r}; list the module names instead "
            '(e.g. ["q_proj", "v_proj"]) in adapter_config.json'
        )
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    numbers_ok = isinstance(r, int) and isinstance(alpha, int | float) and isinstance(dropout, int | float)
    if not numbers_ok or not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(
            f"{where} lacks a readable r, lora_alpha or target_modules list; it is not a LoRA adapter config"
        )
    if isinstance(alpha, float) and alpha.is_integer():
        alpha = int(alpha)
    try:
        return LoRAConfig(r=r, alpha=alpha, dropout=float(dropout), target_modules=tuple(sorted(set(targets))))
    except ValueError as e:
        raise AdapterError(f"{where}: {e}") from None


def blob_from_tensors(tensors: dict[str, torch.Tensor], lora: LoRAConfig) -> bytes:
    """A wire blob of ``tensors`` (made float32, on the CPU) with ``lora``'s shape in its metadata: what
    :func:`peer.model.adapter.adapter_to_bytes` writes for a model holding these weights."""
    lora_dict = lora.to_dict()
    lora_dict.pop("init_seed")
    out = {}
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterError(f"adapter tensor {key} is {t.dtype}, not a float: this is not a LoRA adapter")
        out[key] = t.to("cpu", torch.float32).contiguous()
    return st_save(out, metadata={METADATA_KEY: json.dumps(lora_dict, sort_keys=True)})


def _read_bounded(path: Path, limit: int) -> bytes:
    size = path.stat().st_size
    if size > limit:
        raise AdapterError(f"{path} holds {size:,} bytes, more than an adapter file may ({limit:,})")
    return path.read_bytes()


def _same_shape(a: LoRAConfig, b: LoRAConfig) -> bool:
    return (a.r, a.alpha, a.dropout, set(a.target_modules)) == (b.r, b.alpha, b.dropout, set(b.target_modules))


def read_peft_folder(directory: Path) -> tuple[bytes, LoRAConfig]:
    """The wire blob and LoRA shape of a PEFT folder (any peft-written plain LoRA adapter)."""
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(_read_bounded(config_path, MAX_CONFIG_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_path} is not valid JSON ({e}); restore it or save the adapter again") from None
    lora = lora_of_peft_config(config, config_path)
    weights = directory / ADAPTER_FILE
    if not weights.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise AdapterError(
                f"{directory} holds adapter_model.bin, a pickle hivegrpo does not load (it could run code); save "
                "the adapter with safetensors: model.save_pretrained(DIR, safe_serialization=True)"
            )
        raise AdapterError(f"{directory} has {CONFIG_FILE} but no {ADAPTER_FILE}: the adapter's weights are missing")
    blob = _read_bounded(weights, MAX_ADAPTER_BYTES)
    try:
        own = blob_lora_config(blob)
        if _same_shape(own, lora):
            return blob, own  # written by hivegrpo: the wire blob itself
    except AdapterError:
        pass
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError) as e:
        raise AdapterError(f"{weights} is not a valid safetensors file ({e}); save the adapter again") from None
    return blob_from_tensors(tensors, lora), lora


def read_adapter(path: str | Path) -> tuple[bytes, LoRAConfig]:
    """The wire blob and LoRA shape of any adapter a user may pass: a PEFT folder (hivegrpo's or peft's, a learner's
    checkpoint folder included), a checkpoint folder of an older hivegrpo, or a bare blob file hivegrpo wrote."""
    path = Path(path).expanduser()
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return read_peft_folder(path)
        if (path / OLD_CHECKPOINT_FILE).is_file():
            path = path / OLD_CHECKPOINT_FILE
        else:
            raise AdapterError(
                f"{path} holds no adapter: a PEFT folder has {CONFIG_FILE} and {ADAPTER_FILE} (as "
                "`hivegrpo export`, train-local --save-adapter and learner checkpoints write them)"
            )
    elif not path.is_file():
        raise AdapterError(f"no adapter at {path}: pass a PEFT adapter folder or an adapter .safetensors file")
    elif (path.parent / CONFIG_FILE).is_file() and path.name == ADAPTER_FILE:
        return read_peft_folder(path.parent)
    blob = _read_bounded(path, MAX_ADAPTER_BYTES)
    try:
        return blob, blob_lora_config(blob)
    except AdapterError:
        raise AdapterError(
            f"{path} carries no LoRA configuration of its own: pass the PEFT folder it came from (with its "
            f"{CONFIG_FILE}) instead of the bare weights file"
        ) from None


__all__ = [
    "CONFIG_FILE",
    "base_model_name",
    "blob_from_tensors",
    "lora_of_peft_config",
    "peft_config_dict",
    "read_adapter",
    "read_peft_folder",
    "write_peft_folder",
]
