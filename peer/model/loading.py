"""Loading the base model: ``bundled``, a local directory, or a hub id; quantized nf4/int8 or full precision.

Every peer of a run loads the same base the same way (the run manifest names it), freezes it, and trains or
samples only LoRA adapters on top. Two bitsandbytes facts shape this module (see docs/architecture.md):

* On CPUs with AVX512-BF16, the first no-grad forward of a ``Linear4bit`` repacks its weight for inference,
  irreversibly, after which LoRA gradients through it are silently lost. :func:`disable_cpu_weight_repacking`
  switches that path off on every 4-bit layer before any forward; it is applied unconditionally.
* 8-bit matmuls on CPU warn on every call; that one warning is filtered.
* On CPU, a ``Linear4bit`` de-quantizes its whole weight at every forward, then multiplies in the compute dtype.
  With float32 compute, :func:`unpack_4bit` does that de-quantization once at load (every ``Linear4bit`` becomes a
  ``Linear`` holding exactly those float32 values): the same logits and LoRA gradients, bit for bit, in ~20 % less
  time per forward, for 8x the weights' memory. :func:`load_base` does it when the copy fits (:func:`unpack_room`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from peer.errors import UserError
from peer.log import get_logger
from peer.model.config import BUNDLED, ModelConfig, check_device_present, check_model_name, cuda_index

logger = get_logger(__name__)


class ModelLoadError(UserError, RuntimeError):
    """The base model could not be found or loaded; the message says what to check."""


@dataclass
class LoadedBase:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str  # the directory or hub id it came from
    device: torch.device
    quantization: str
    dtype: torch.dtype = torch.float32  # the compute dtype of the forward passes
    unpacked: bool = False  # the 4-bit weights are held de-quantized (float32, the same values): unpack_4bit


def bundled_path() -> Path:
    """Directory of the tiny base model shipped inside the package."""
    return Path(str(resources.files("peer.model") / "bundled"))


def resolve_device(device: str) -> torch.device:
    """``auto`` → the first GPU when torch sees one, else the CPU; ``cuda``/``cuda:N`` only if that GPU exists."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    try:
        check_device_present(device)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return torch.device("cuda", cuda_index(device))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype: as asked, or ``auto`` → float32 on CPU, bfloat16 on a GPU that supports it, else float16.

    Any of the three runs on CPU too (slower in 16 bits), so a mixed-precision swarm can be tried on one machine. A
    GPU without bfloat16 (before Ampere) is refused for it, with the dtype to use instead.
    """
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ModelLoadError(f"--dtype bfloat16: {name} does not support bfloat16; use --dtype float16 or auto")
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None


def resolve_source(name: str) -> str:
    """Map ``bundled`` to the packaged directory; keep local directories and hub ids as they are."""
    if name == BUNDLED:
        path = bundled_path()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the bundled model is missing from {path}; reinstall hivegrpo")
        return str(path)
    try:
        check_model_name(name)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    path = Path(name).expanduser()
    return str(path) if path.exists() else name  # a hub id, resolved by transformers (and its cache) at load time


def _quantization_config(quantization: str, dtype: torch.dtype):
    if quantization == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as e:  # pragma: no cover - bitsandbytes is a dependency
        raise ModelLoadError(f"bitsandbytes is not importable ({e}); install it or use --quantization none") from e
    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def disable_cpu_weight_repacking(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' irreversible AVX512-BF16 inference repacking on every 4-bit layer; returns count."""
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def unpack_bytes(model: torch.nn.Module) -> int:
    """Bytes the 4-bit weights of ``model`` would take held in float32."""
    import bitsandbytes as bnb

    return sum(m.in_features * m.out_features * 4 for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


def unpack_room(model: torch.nn.Module, max_memory: int | None) -> str | None:
    """None if the float32 copy of ``model``'s 4-bit weights fits (:func:`peer.model.memory.room_for`), else why
    not."""
    from peer.model.memory import room_for

    return room_for(model, unpack_bytes(model), max_memory)


def unpack_4bit(model: torch.nn.Module) -> int:
    """Replace every ``Linear4bit`` of ``model`` by a frozen float32 ``Linear`` holding its weight de-quantized by
    bitsandbytes, as its CPU forward de-quantizes it at every call; returns how many. Only for float32 compute on
    CPU, where the results are the same bit for bit (bfloat16 ones differ, and run no faster)."""
    import bitsandbytes as bnb

    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).to(torch.float32)
        with torch.device("meta"):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = torch.nn.Parameter(module.bias.data.to(torch.float32), requires_grad=False)
        model.set_submodule(name, linear)
        count += 1
    quantizer = getattr(model, "hf_quantizer", None)
    if count and quantizer is not None:  # a plain float32 model now (transformers' own dequantize() does the same)
        quantizer.remove_quantization_config(model)
    return count


def load_tokenizer(source: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation continues every prompt from its last token
    return tokenizer


def load_base(config: ModelConfig, *, unpack: bool = True, max_memory: int | None = None) -> LoadedBase:
    """Load the frozen base model and its tokenizer as ``config`` says.

    An nf4 base computing in float32 on CPU is unpacked (:func:`unpack_4bit`) when ``unpack`` and the copy fits
    (:func:`unpack_room`, ``max_memory`` being a rollout peer's ``--max-memory``); the numbers are the same.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source = resolve_source(config.name)
    quant = _quantization_config(config.quantization, dtype)
    device_map = {"": device.index} if device.type == "cuda" else {"": "cpu"}
    revision = None if Path(source).exists() else config.revision
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
            model = AutoModelForCausalLM.from_pretrained(
                source, revision=revision, quantization_config=quant, dtype=dtype, device_map=device_map
            )
        tokenizer = load_tokenizer(source, revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"could not load model {config.name!r}: {str(e).rstrip('.')}. Pass 'bundled', a local model directory, "
            "or a hub id this machine can download (check the network and the id's spelling)"
        ) from e
    disable_cpu_weight_repacking(model)
    unpacked = False
    if unpack and config.quantization == "nf4" and device.type == "cpu" and dtype == torch.float32:
        why = unpack_room(model, max_memory)
        if why is None:
            unpacked = unpack_4bit(model) > 0
        else:
            logger.info("4-bit weights kept packed (slower on CPU): %s", why)
    model.requires_grad_(False)
    model.eval()
    held = ", unpacked to float32" if unpacked else ""
    logger.info(
        "loaded %s (%s%s, %s, %s)", config.name, config.quantization, held, str(dtype).removeprefix("torch."), device
    )
    return LoadedBase(model, tokenizer, source, device, config.quantization, dtype, unpacked)
