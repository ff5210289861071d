"""Typed configuration of the base model and its LoRA adapter (both go into a run manifest)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

# The values ModelConfig accepts, here once: the command line's choices and checks come from these.
QUANTIZATIONS = ("nf4", "int8", "none")  # how the frozen base is held (bitsandbytes), or not quantized
DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N", one GPU by its index (check_device)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # compute dtype; auto picks by device (loading.resolve_dtype)
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_device(device: str) -> str:
    """``device`` if it names one this project runs on (``auto``, ``cpu``, ``cuda``, ``cuda:N``), else ValueError."""
    if device in DEVICES:
        return device
    index = device.removeprefix("cuda:")
    if device.startswith("cuda:") and index.isdigit() and len(index) <= 3:
        return device
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N (N a GPU index, e.g. cuda:1), got {device!r}")


def cuda_index(device: str) -> int:
    """The GPU index of ``cuda`` (0) or ``cuda:N`` (N)."""
    return int(device.removeprefix("cuda").removeprefix(":") or 0)


def check_device_present(device: str) -> None:
    """ValueError unless torch sees the GPU that ``device`` (a :func:`check_device` name) asks for; ``auto`` and
    ``cpu`` always pass. Imports torch, and creates no CUDA context."""
    if device in ("auto", "cpu"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but torch sees no CUDA device; use --device cpu or auto")
    index = cuda_index(device)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: torch sees {count} GPU(s), numbered 0 to {count - 1}; pick one of those")


BUNDLED = "bundled"
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def check_model_name(name: str) -> str:
    """``name`` if it can name a base model, else ValueError saying what to pass: ``bundled``, a model directory
    (one holding config.json) or a hub id. Reads only the file system: whether a hub id exists shows when it loads."""
    if name == BUNDLED:
        return name
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} exists but holds no config.json: point --model at a model directory")
        return name
    if name.startswith(LOCAL_PATH_PREFIXES):
        raise ValueError(f"no model directory at {path}: check the path, or pass 'bundled' or a hub id")
    if HUB_ID.fullmatch(name) is None:
        raise ValueError(
            f"{name!r} is neither a model directory nor a hub id (like HuggingFaceTB/SmolLM2-135M-Instruct): "
            "check the path, or pass 'bundled'"
        )
    return name


def _from_dict(cls, data: dict):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; allowed: {sorted(known)}")
    return cls(**data)


@dataclass(frozen=True)
class ModelConfig:
    name: str = field(default=BUNDLED, metadata={"help": "'bundled', a model directory or a hub id"})
    quantization: str = field(
        default="nf4",
        metadata={"help": "how the frozen base weights are held: nf4 or int8 (bitsandbytes), or none"},
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "where to compute: cpu, cuda (the first GPU), cuda:N (GPU N) or auto (a GPU when torch sees one)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "compute dtype; auto: bfloat16 on a GPU that has it (else float16), float32 on CPU"},
    )
    revision: str | None = field(default=None, metadata={"help": "hub revision of the model (ignored for local ones)"})

    def __post_init__(self):
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check_device(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.name:
            raise ValueError("model name is empty: pass 'bundled', a local directory or a hub id")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class LoRAConfig:
    r: int = field(default=8, metadata={"help": "LoRA rank"})
    alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    target_modules: tuple[str, ...] = field(
        default=DEFAULT_TARGET_MODULES, metadata={"help": "names of the linear layers that get an adapter"}
    )
    init_seed: int = field(default=0, metadata={"help": "seed of the adapter's initial weights (version 0)"})

    def __post_init__(self):
        if not 1 <= self.r <= 1024:
            raise ValueError(f"LoRA r must be in 1..1024, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty: name at least one linear layer, e.g. q_proj")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> LoRAConfig:
        return _from_dict(cls, data)
