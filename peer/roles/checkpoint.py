"""Learner checkpoints: ``DIR/{checkpoint.json, adapter.safetensors, optimizer.pt}``, written atomically."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from peer.errors import UserError
from peer.model.adapter import sha256_hex

CHECKPOINT_META = "checkpoint.json"


def write_checkpoint(directory: Path, meta: dict, adapter: bytes, optimizer_state: dict) -> None:
    """Write ``directory/{checkpoint.json, adapter.safetensors, optimizer.pt}`` atomically (a crash mid-write
    leaves the previous checkpoint whole)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / "adapter.safetensors").write_bytes(adapter)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / CHECKPOINT_META).write_text(json.dumps(meta))
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    if old.exists():
        shutil.rmtree(old)


def read_checkpoint(directory: Path) -> tuple[dict, bytes, dict] | None:
    """(meta, adapter bytes, optimizer state) or None when ``directory`` holds no checkpoint; UserError when it
    holds a broken one."""
    directory = Path(directory)
    if not (directory / CHECKPOINT_META).exists():
        return None
    try:
        meta = json.loads((directory / CHECKPOINT_META).read_text())
        blob = (directory / "adapter.safetensors").read_bytes()
        if sha256_hex(blob) != meta["sha256"]:
            raise ValueError(f"adapter.safetensors hashes to {sha256_hex(blob)[:12]}…, not {meta['sha256'][:12]}…")
        optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
        int(meta["version"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(
            f"the checkpoint in {directory} is unreadable ({e}); move it away to resume from the swarm instead"
        ) from e
    return meta, blob, optimizer_state


__all__ = ["CHECKPOINT_META", "read_checkpoint", "write_checkpoint"]
