"""Learner checkpoints: ``DIR/{checkpoint.json, adapter_model.safetensors, adapter_config.json, optimizer.pt}``,
written atomically, and the journal ``DIR/journal.jsonl`` of the versions made since.

A checkpoint folder is also a PEFT folder (:mod:`peer.model.peft_folder`): ``PeftModel.from_pretrained(base, DIR)``,
``hivegrpo eval --adapter DIR`` and ``hivegrpo export --adapter DIR`` read its adapter as they are. Checkpoints of
older versions (``adapter.safetensors``, no config) are still read.

A checkpoint is written every few versions (it holds the AdamW state, too large to write every update). The
journal fills the gap: one short line per version made or applied — its number, sha256, parent and the intake's
delta (the seqs its update used, new bans), and the contributors' credit that changed since the line before
(``credit``, :mod:`peer.run.credit`) — appended before the version is announced. A learner killed between
two checkpoints resumes from the checkpoint plus the journal's chain of versions after it (their adapters are in
its blob cache), so no version it announced is lost and no group is used twice. Writing a checkpoint starts an
empty journal (the directory is replaced as a whole).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from peer.errors import UserError
from peer.model.adapter import ADAPTER_FILE, sha256_hex
from peer.model.peft_folder import OLD_CHECKPOINT_FILE, write_peft_folder
from peer.run.credit import CreditTable

CHECKPOINT_META = "checkpoint.json"
JOURNAL = "journal.jsonl"


def write_checkpoint(directory: Path, meta: dict, adapter: bytes, optimizer_state: dict, base_model: str) -> None:
    """Write ``directory`` (the PEFT folder of ``adapter``, a blob of a model on ``base_model``, with
    ``checkpoint.json`` and ``optimizer.pt``) atomically: a crash mid-write leaves the previous checkpoint whole."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_peft_folder(tmp, adapter, base_model)
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
        adapter_file = directory / ADAPTER_FILE
        if not adapter_file.exists():
            adapter_file = directory / OLD_CHECKPOINT_FILE
        blob = adapter_file.read_bytes()
        if sha256_hex(blob) != meta["sha256"]:
            raise ValueError(f"{adapter_file.name} hashes to {sha256_hex(blob)[:12]}…, not {meta['sha256'][:12]}…")
        optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
        int(meta["version"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(
            f"the checkpoint in {directory} is unreadable ({e}); move it away to resume from the swarm instead"
        ) from e
    return meta, blob, optimizer_state


def append_journal(
    directory: Path, version: int, sha: str, parent: str, intake_delta: dict, credit: dict | None = None
) -> None:
    """Add version ``version`` (``sha``, child of ``parent``, its update's intake delta) to the journal;
    ``credit``: the contributors whose credit changed since the line before (:mod:`peer.run.credit`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    line = {"version": version, "sha": sha, "parent": parent, "intake": intake_delta}
    if credit is not None:
        line["credit"] = credit
    with open(directory / JOURNAL, "ab+") as f:  # flushed at close: a killed process loses no line the OS has
        torn = f.seek(0, os.SEEK_END) > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
        # a line a kill cut short ends without a newline: start on a fresh line, or this one would be lost with it
        f.write((b"\n" if torn else b"") + json.dumps(line, separators=(",", ":")).encode() + b"\n")


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


@dataclass(frozen=True)
class ResumePlan:
    """Where a learner starting with a checkpoint directory goes on from (:func:`plan_resume`).

    ``own``: its own state is at least as new as the swarm's newest version, and the learner takes it:
    ``version``/``sha``/``parent``, after the checkpoint (if ``checkpointed``) the journal's ``chain`` of versions
    (the adapter is then the last chained version's cached blob, else the checkpoint's). Not ``own``: it continues
    from the swarm's version; ``rewrite`` then says its directory holds an older or other lineage, to be
    checkpointed over at start."""

    own: bool
    version: int = 0
    sha: str = ""
    parent: str = ""
    chain: tuple[dict, ...] = ()
    checkpointed: bool = False
    rewrite: bool = False

    def describe(self, directory) -> str:
        """How the learner's summary names where it resumed from."""
        if not self.own:
            return "swarm"
        text = f"{'checkpoint' if self.checkpointed else 'journal'} {directory}"
        if self.chain and self.checkpointed:
            text += f" + {len(self.chain)} journalled version(s)"
        return text


def plan_resume(meta: dict | None, chain: list[dict], cached, announced: tuple[int, str]) -> ResumePlan:
    """Decide where a learner resumes (pure: no file, no network).

    ``meta``: its checkpoint's ``checkpoint.json`` (None: no checkpoint; the journal then chains from v0);
    ``chain``: :func:`journal_chain` from the checkpoint's version; ``cached(sha)``: whether the
    blob cache holds that adapter (the chain ends at the newest version it holds); ``announced``: the swarm's newest
    ``(version, sha)`` as the session took it."""
    chain = list(chain)
    while chain and not cached(chain[-1]["sha"]):
        chain.pop()
    if meta is None and not chain:
        return ResumePlan(own=False)  # nothing of this learner's own beyond v0
    version, sha = (chain[-1]["version"], chain[-1]["sha"]) if chain else (meta["version"], meta["sha256"])
    swarm_version, swarm_sha = announced
    if version < swarm_version or (version == swarm_version and sha != swarm_sha):
        return ResumePlan(own=False, version=version, sha=sha, rewrite=True)
    parent = chain[-1]["parent"] if chain else meta["parent_sha256"]
    return ResumePlan(
        own=True,
        version=version,
        sha=sha,
        parent=parent,
        chain=tuple(chain),
        checkpointed=meta is not None,
    )


def restore_credit(table: CreditTable, meta: dict, directory: Path) -> int:
    """Merge the credit of a learner's checkpoint (``meta``: its ``checkpoint.json``) and of every journal line in
    ``directory`` (each holds the contributors that changed before it, with absolute counts). Lines of another
    lineage count too: credit is the run's, not a lineage's. Returns how many journal lines held credit."""
    if "credit" in meta:
        table.load(meta["credit"], f"{directory}/checkpoint.json")
    try:
        text = (Path(directory) / JOURNAL).read_text()
    except FileNotFoundError:
        return 0
    lines = 0
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(line, dict) and "credit" in line:
            table.load(line["credit"], f"{directory}/{JOURNAL}")
            lines += 1
    return lines


__all__ = [
    "CHECKPOINT_META",
    "JOURNAL",
    "append_journal",
    "journal_chain",
    "read_checkpoint",
    "restore_credit",
    "write_checkpoint",
]
