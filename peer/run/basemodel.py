"""Getting the run's base model files onto this machine, every byte checked against the manifest's sha256.

The manifest lists each file of the base model (relative path, sha256, size). :func:`resolve_base` makes a model
folder holding exactly those files, trying sources in order, per file:

1. **local**: the peer's blob cache (files fetched before), the packaged model when the manifest names
   ``bundled``, and the Hugging Face cache (``~/.cache/huggingface/hub`` or ``HF_HUB_CACHE``) when it names a hub
   id — a file is used where it is only if it hashes to the manifest's sha256 (a host's local folder is published
   by its base name only, which is never looked up on this disk);
2. **P2P**: any live peer of the swarm (the coordinator first) that serves the blob — every peer that loaded the
   model serves its files from its cache;
3. **hub**: the model hub id the manifest names (``huggingface_hub.hf_hub_download`` at the manifest's revision).

Nothing unverified is ever placed where the loader looks: fetched bytes land in the blob cache only once they hash
right (a corrupt or truncated transfer is dropped and the next provider is tried), and the model folder is a set
of links into the cache, made in a temporary folder and renamed into place. When no source has a file,
:class:`ModelSourceError` says, for each source, why not.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from peer.errors import UserError
from peer.log import get_logger
from peer.network.blobs.cache import BlobCache, sha256_file
from peer.protocol import ModelFile, ModelSpec

logger = get_logger(__name__)

Fetch = Callable[[str, int, Callable[[int, int], None]], Path]  # (sha256, size, progress) -> cached path


class ModelSourceError(UserError, RuntimeError):
    """No source delivered a base model file that hashes to what the manifest says."""


def model_files(folder: Path | str) -> list[ModelFile]:
    """The manifest entries of every regular file in a model folder (hidden files and sub-folders skipped)."""
    folder = Path(folder)
    out = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            sha, size = sha256_file(path)
            out.append(ModelFile(path=path.name, sha256=sha, size=size))
    if not any(f.path == "config.json" for f in out):
        raise ModelSourceError(f"{folder} holds no config.json: it is not a model folder")
    return out


def _local_folder(name: str) -> Path | None:
    """Only the packaged model is looked for on disk by name: any other name is the host's, not a local path."""
    from peer.model.loading import BUNDLED, bundled_path

    return bundled_path() if name == BUNDLED else None


def _is_hub_id(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None


class _ProgressBar:
    """A rich progress bar on a terminal, a log line every few seconds otherwise."""

    def __init__(self, total_files: int, total_bytes: int):
        self.total_bytes = total_bytes
        self._bar = None
        self._last = 0.0
        if sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self._bar = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
            self._bar.start()
        self._task = None
        logger.info("fetching %d base model file(s), %.1f MiB", total_files, total_bytes / 2**20)

    def file(self, path: str, size: int) -> Callable[[int, int], None]:
        if self._bar is not None:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task = self._bar.add_task(path, total=size)

        def report(done: int, total: int) -> None:
            if self._bar is not None:
                self._bar.update(self._task, completed=done)
            elif time.monotonic() - self._last > 2.0 or done == total:
                self._last = time.monotonic()
                logger.info("  %s: %d%% of %.1f MiB", path, 100 * done // max(total, 1), total / 2**20)

        return report

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _hub_cached(spec: ModelSpec, path: str) -> Path | None:
    """Where the Hugging Face cache holds ``path`` of the manifest's hub model (at its revision), without asking
    the network; None when it does not (or the name is no hub id)."""
    if not _is_hub_id(spec.name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec.name, path, revision=spec.revision)
    except Exception:  # a malformed cache or name: the other sources are tried
        return None
    return Path(found) if isinstance(found, str) else None


def _from_local(spec: ModelSpec, cache: BlobCache, missing: list[ModelFile], why: dict[str, list[str]]) -> None:
    folder = _local_folder(spec.name)
    for f in list(missing):
        if cache.has(f.sha256):
            missing.remove(f)
            continue
        if folder is not None:
            candidate = folder / f.path
        else:
            candidate = _hub_cached(spec, f.path)
            if candidate is None:
                continue
        if not candidate.is_file():
            why[f.path].append(f"local: {candidate} does not exist")
            continue
        actual, _ = sha256_file(candidate)
        if actual != f.sha256:
            why[f.path].append(f"local: {candidate} hashes to {actual[:12]}…, not {f.sha256[:12]}…")
            continue
        cache.adopt(candidate, sha256=f.sha256)  # served from where it is; never copied
        missing.remove(f)


def _from_peers(fetch: Fetch | None, missing: list[ModelFile], why: dict[str, list[str]]) -> None:
    if fetch is None or not missing:
        return
    bar = _ProgressBar(len(missing), sum(f.size for f in missing))
    try:
        for f in list(missing):
            try:
                fetch(f.sha256, f.size, bar.file(f.path, f.size))
            except UserError as e:  # BlobUnavailable: every provider failed; it says why
                why[f.path].append(f"P2P: {e}")
                continue
            missing.remove(f)
    finally:
        bar.close()


def _from_hub(spec: ModelSpec, cache: BlobCache, missing: list[ModelFile], why: dict[str, list[str]]) -> None:
    if not missing or not _is_hub_id(spec.name):
        return
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        for f in missing:
            why[f.path].append(f"hub: huggingface_hub is not importable ({e})")
        return
    for f in list(missing):
        try:
            local = hf_hub_download(spec.name, f.path, revision=spec.revision)
            cache.put_file(local, sha256=f.sha256)
        except Exception as e:  # the hub raises many types; each is one line of the final error
            why[f.path].append(f"hub: {spec.name}/{f.path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        missing.remove(f)


def _folder_name(spec: ModelSpec) -> str:
    digest = hashlib.sha256("\n".join(f"{f.path} {f.sha256}" for f in spec.files).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.name.strip("/~."))[-48:] or "model"
    return f"{slug}-{digest}"


def _link(target: Path, link: Path) -> None:
    try:
        os.symlink(target, link)
    except OSError:  # no symlinks here (some Windows set-ups): a copy of a verified file is as good
        shutil.copyfile(target, link)


def materialize(spec: ModelSpec, cache: BlobCache, models_root: Path) -> Path:
    """A folder with every manifest file linked to its verified blob; made aside, then renamed into place."""
    models_root.mkdir(parents=True, exist_ok=True)
    final = models_root / _folder_name(spec)
    wanted = {f.path: cache.path(f.sha256) for f in spec.files}
    if final.is_dir() and all((final / p).resolve() == t.resolve() for p, t in wanted.items()):
        return final
    tmp = models_root / f".{final.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for path, target in wanted.items():
        _link(target, tmp / path)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def resolve_base(spec: ModelSpec, cache: BlobCache, models_root: Path, fetch: Fetch | None = None) -> Path:
    """A local folder holding the manifest's base model files, verified; :class:`ModelSourceError` if impossible.

    :param fetch: ``fetch(sha256, size, progress)`` from the swarm's providers (None: no P2P source)
    """
    missing = list(spec.files)
    why: dict[str, list[str]] = {f.path: [] for f in missing}
    _from_local(spec, cache, missing, why)
    _from_peers(fetch, missing, why)
    _from_hub(spec, cache, missing, why)
    if missing:
        first = missing[0]
        tried = "; ".join(w.rstrip(".") for w in why[first.path]) or "no source has it"
        raise ModelSourceError(
            f"no source has base model file {first.path!r} (sha256 {first.sha256[:12]}…, {first.size} bytes) of "
            f"{spec.name!r}"
            + (f", nor {len(missing) - 1} other file(s)" if len(missing) > 1 else "")
            + f" — {tried}. Check that the host is online and serves the model, or that this machine can reach "
            "the model hub; a file that hashes differently means the host's model changed since the manifest"
        )
    return materialize(spec, cache, models_root)


def fetch_from(blobs, providers: Callable[[], Sequence]) -> Fetch:
    """A :data:`Fetch` over a BlobService that asks ``providers()`` (PeerIDs, in the order to ask them: the
    coordinator first) anew for each file."""

    def fetch(sha256: str, size: int, progress: Callable[[int, int], None]) -> Path:
        return blobs.fetch(sha256, size, providers(), progress=progress, timeout=60.0, shuffle=False)

    return fetch
