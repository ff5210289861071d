"""A content-addressed blob store on disk.

Layout under ``root``::

    objects/ab/abcdef...       blobs the cache owns, named by their sha256 (lowercase hex)
    index/ab/abcdef....json    one record per verified blob: {"size", "mtime_ns", "ctime_ns", "ino", "path"}
    tmp/*.part                 files being written; on the same filesystem as objects/, so a rename is atomic

Trust rule: a file name is never taken for its hash. A blob counts as present only when an index record says its
sha256 was computed over that file and the file's size, mtime, ctime and inode still match what they were then
(any write, rename, copy or ``touch`` changes one of them; ctime cannot be set back by user tools). Otherwise the
cache re-hashes the file once (lazily, on the next ``has``/``path``) and records the result, or drops it: an owned
file that fails is deleted, an adopted one is only forgotten (the cache never deletes files it does not own).
What a stat cannot see (bit rot, a rewrite within one timestamp tick of the check) ``verify`` finds: it re-hashes
in full, and loaders of critical files may call it.

Writes are atomic: bytes go to ``tmp/``, are hashed on the way, and are renamed into ``objects/`` only after the
sha256 (and size, when known) matched. Index records are written the same way, after the rename. Several processes
may share one cache; the worst a race can do is make a record stale, which the next lookup re-hashes.

``adopt`` records the hash of a file that stays where it is (e.g. a model file shipped with the package, seeded by
the coordinator without a copy); ``path`` then returns that file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import BinaryIO

from peer.log import get_logger
from peer.network.blobs.errors import BlobCorrupt

logger = get_logger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COPY_CHUNK = 1 << 20
_STALE_PART_S = 24 * 3600


_STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "ino")


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def check_sha256(sha256: object) -> str:
    """Return ``sha256`` if it is 64 lowercase hex digits, else raise ValueError (names come from the network)."""
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise ValueError(f"not a sha256 (64 lowercase hex digits): {sha256!r:.80}")
    return sha256


def sha256_file(path: Path) -> tuple[str, int]:
    """sha256 and size of a file, read in 1 MiB pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class PendingBlob:
    """A blob being written into the cache: ``write`` hashes and stores, ``commit`` verifies and publishes it.

    Nothing is visible in the cache until ``commit`` succeeds; leaving the ``with`` block without a commit (or with
    an exception) deletes the partial file. ``write`` may run in a worker thread (hashing and file writes release
    the GIL), but calls must not overlap.
    """

    def __init__(self, cache: BlobCache, sha256: str | None, size: int | None):
        self._cache, self.sha256, self.size = cache, sha256, size
        self._digest = hashlib.sha256()
        self.written = 0
        self._tmp = cache.root / "tmp" / f"{secrets.token_hex(8)}.part"
        self._file: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._done = False

    def write(self, chunk: bytes | memoryview) -> None:
        self._digest.update(chunk)
        self._file.write(chunk)
        self.written += len(chunk)

    def commit(self) -> Path:
        """Check size and sha256, then move the file into the cache atomically; returns its path there."""
        if self._done:
            raise RuntimeError("this pending blob was already committed or aborted")
        try:
            self._file.flush()
            if self._cache.fsync:
                os.fsync(self._file.fileno())
            self._file.close()
            actual = self._digest.hexdigest()
            if self.size is not None and self.written != self.size:
                raise BlobCorrupt(f"blob {self._label()} has {self.written} bytes, expected {self.size}")
            if self.sha256 is not None and actual != self.sha256:
                raise BlobCorrupt(f"blob {self._label()} hashes to {actual[:12]}…, which is not the sha256 expected")
            final = self._cache._object_path(actual)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._tmp, final)
            self.sha256 = actual
            self._cache._write_record(actual, final, owned=True)
            self._done = True
            return final
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Throw the partial file away (idempotent)."""
        self._done = True
        if self._file is not None and not self._file.closed:
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def _label(self) -> str:
        return f"{self.sha256[:12]}…" if self.sha256 else "(unnamed)"

    def __enter__(self) -> PendingBlob:
        return self

    def __exit__(self, *exc) -> None:
        if not self._done:
            self.abort()


class BlobCache:
    """Blobs on disk, addressed by sha256; see the module docstring for the layout and the trust rule.

    :param root: the cache folder (created if missing)
    :param fsync: fsync each blob before its rename (durable across a power cut; slower). Off by default: after a
      crash a half-written blob fails its stat check and then its re-hash, and is fetched again.
    """

    def __init__(self, root: Path | str, *, fsync: bool = False):
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync
        for sub in ("objects", "index", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._clean_stale_parts()

    # --- lookups -------------------------------------------------------------------------------------------------

    def has(self, sha256: str) -> bool:
        """True when the blob is here and its hash has been checked (re-hashing once if its file changed)."""
        return self._lookup(check_sha256(sha256)) is not None

    def path(self, sha256: str) -> Path:
        """Path of a verified blob (owned or adopted); raises KeyError when the cache does not hold it."""
        found = self._lookup(check_sha256(sha256))
        if found is None:
            raise KeyError(f"blob {sha256[:12]}… is not in the cache at {self.root}")
        return found

    def size(self, sha256: str) -> int:
        return self.path(sha256).stat().st_size

    def open(self, sha256: str) -> BinaryIO:
        """Open a verified blob for binary reading; raises KeyError when absent."""
        return open(self.path(sha256), "rb")  # noqa: SIM115 - the caller closes it

    def list(self) -> list[str]:
        """sha256 of every blob with an index record (unchecked: call ``has`` to verify one)."""
        return sorted(p.stem for p in (self.root / "index").glob("*/*.json"))

    def verify(self, sha256: str) -> bool:
        """Re-hash the blob in full now; drop it (as on a failed lazy check) if it no longer matches."""
        check_sha256(sha256)
        found = self._lookup(sha256)
        if found is None:
            return False
        actual, _ = sha256_file(found)
        if actual == sha256:
            return True
        self._forget(sha256, found, reason=f"re-hash gave {actual[:12]}…")
        return False

    # --- writes --------------------------------------------------------------------------------------------------

    def incoming(self, sha256: str | None = None, size: int | None = None) -> PendingBlob:
        """Start writing a blob; with ``sha256``/``size`` given, ``commit`` refuses bytes that do not match."""
        if sha256 is not None:
            check_sha256(sha256)
        return PendingBlob(self, sha256, size)

    def put_bytes(self, data: bytes, *, sha256: str | None = None) -> str:
        """Store bytes; returns their sha256. With ``sha256`` given, raises BlobCorrupt when it does not match."""
        actual = hashlib.sha256(data).hexdigest()
        if sha256 is not None and check_sha256(sha256) != actual:
            raise BlobCorrupt(f"bytes hash to {actual[:12]}…, not to the expected {sha256[:12]}…")
        if self.has(actual):
            return actual
        with self.incoming(actual, len(data)) as pending:
            pending.write(data)
            pending.commit()
        return actual

    def put_file(self, path: Path | str, *, sha256: str | None = None, adopt: bool = False) -> str:
        """Copy a file into the cache, hashing while copying; returns its sha256.

        With ``adopt=True`` nothing is copied: the file's hash is recorded and ``path()`` will return the file where
        it is, as long as its stat stays the same (it is re-hashed once if that changes).
        """
        path = Path(path).expanduser().resolve()
        if sha256 is not None:
            check_sha256(sha256)
            if not adopt and self.has(sha256):
                return sha256
        if adopt:
            actual, _ = sha256_file(path)
            if sha256 is not None and actual != sha256:
                raise BlobCorrupt(f"{path} hashes to {actual[:12]}…, not to the expected {sha256[:12]}…")
            self._write_record(actual, path, owned=False)
            return actual
        with self.incoming(sha256) as pending, open(path, "rb") as src:
            while chunk := src.read(_COPY_CHUNK):
                pending.write(chunk)
            pending.commit()
            return pending.sha256

    def adopt(self, path: Path | str, *, sha256: str | None = None) -> str:
        """Record a file's hash without copying it (see ``put_file``)."""
        return self.put_file(path, sha256=sha256, adopt=True)

    def remove(self, sha256: str) -> None:
        """Forget a blob; its file is deleted only if the cache owns it."""
        check_sha256(sha256)
        with contextlib.suppress(FileNotFoundError):
            self._index_path(sha256).unlink()
        with contextlib.suppress(FileNotFoundError):
            self._object_path(sha256).unlink()

    # --- internals -----------------------------------------------------------------------------------------------

    def _object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / sha256

    def _index_path(self, sha256: str) -> Path:
        return self.root / "index" / sha256[:2] / f"{sha256}.json"

    def _read_record(self, sha256: str) -> dict | None:
        try:
            record = json.loads(self._index_path(sha256).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            logger.warning(f"unreadable index record for blob {sha256[:12]}…; it will be re-hashed")
            return None
        ok = (
            isinstance(record, dict)
            and isinstance(record.get("size"), int)
            and isinstance(record.get("mtime_ns"), int)
        )
        return record if ok and isinstance(record.get("path"), str | None) else None

    def _write_record(self, sha256: str, path: Path, *, owned: bool) -> None:
        record = {**_stat_key(path.stat()), "path": None if owned else str(path)}
        target = self._index_path(sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "tmp" / f"{secrets.token_hex(8)}.json.part"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, target)

    def _lookup(self, sha256: str) -> Path | None:
        record = self._read_record(sha256)
        owned_path = self._object_path(sha256)
        target = Path(record["path"]) if record and record["path"] else owned_path
        try:
            st = target.stat()
        except FileNotFoundError:
            if record is not None:
                self._forget(sha256, target, reason="its file is gone")
            return None
        if record is not None and all(record[k] == v for k, v in _stat_key(st).items()):
            return target
        actual, _ = sha256_file(target)  # first sight of this file, or it changed since it was checked
        if actual != sha256:
            self._forget(sha256, target, reason=f"its file hashes to {actual[:12]}…")
            return None
        self._write_record(sha256, target, owned=target == owned_path)
        return target

    def _forget(self, sha256: str, target: Path, *, reason: str) -> None:
        logger.warning(f"dropping blob {sha256[:12]}… from the cache at {self.root}: {reason}")
        with contextlib.suppress(FileNotFoundError):
            self._index_path(sha256).unlink()
        if target == self._object_path(sha256):
            with contextlib.suppress(FileNotFoundError):
                target.unlink()

    def _clean_stale_parts(self) -> None:
        cutoff = time.time() - _STALE_PART_S
        for part in (self.root / "tmp").glob("*.part"):
            with contextlib.suppress(FileNotFoundError):
                if part.stat().st_mtime < cutoff:
                    part.unlink()
