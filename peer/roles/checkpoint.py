"""Learner checkpoints: ``DIR/{checkpoint.json, adapter.safetensors, optimizer.pt}``, written atomically, and the
journal ``DIR/journal.jsonl`` of the versions made since.

A checkpoint is written every few versions (it holds the AdamW state, too large to write every update). The
journal fills the gap: one short line per version made or applied — its number, sha256, parent and the intake's
delta (the seqs its update used, new bans) — appended before the version is announced. A learner killed between
two checkpoints resumes from the checkpoint plus the journal's chain of versions after it (their adapters are in
its blob cache), so no version it announced is lost and no group is used twice. Writing a checkpoint starts an
empty journal (the directory is replaced as a whole).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from peer.errors import UserError
from peer.model.adapter import sha256_hex

CHECKPOINT_META = "checkpoint.json"
JOURNAL = "journal.jsonl"


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


def append_journal(directory: Path, version: int, sha: str, parent: str, intake_delta: dict) -> None:
    """Add version ``version`` (``sha``, child of ``parent``, its update's intake delta) to the journal."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    line = {"version": version, "sha": sha, "parent": parent, "intake": intake_delta}
    with open(directory / JOURNAL, "a") as f:  # flushed at close: a killed process loses no line the OS has
        f.write(json.dumps(line, separators=(",", ":")) + "\n")


def journal_chain(directory: Path, version: int, sha: str) -> list[dict]:
    """The journal's versions after ``version``/``sha``, each the child of the one before (lines of another
    lineage, and a line cut short by a crash, are skipped)."""
    try:
        text = (Path(directory) / JOURNAL).read_text()
    except FileNotFoundError:
        return []
    children: dict[tuple[int, str], dict] = {}
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
            key = (int(line["version"]) - 1, str(line["parent"]))
            if not (isinstance(line["sha"], str) and isinstance(line["intake"], dict)):
                raise TypeError("sha and intake")
        except (ValueError, KeyError, TypeError):
            continue
        children[key] = line
    chain = []
    while (version, sha) in children:
        line = children[(version, sha)]
        chain.append(line)
        version, sha = line["version"], line["sha"]
    return chain


__all__ = ["CHECKPOINT_META", "JOURNAL", "append_journal", "journal_chain", "read_checkpoint", "write_checkpoint"]
