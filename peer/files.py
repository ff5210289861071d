"""Writing files that hold secrets: signing keys, identities, invite books, the host's info file.

:func:`write_private` writes to a fresh temporary file that is *created* with mode 0600 (``O_CREAT | O_EXCL``)
and then renamed over the target. Writing first and ``chmod``-ing after leaves a moment in which another local
user may open the file (and keep it open); a rename also means a reader never sees half a file, and a crash
leaves the old one in place.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PRIVATE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def write_private(path: Path | str, data: bytes | str) -> None:
    """Replace ``path`` atomically with ``data`` (text is UTF-8) in a file only its owner can read or write.

    A missing parent folder is created with mode 0700.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    if not path.parent.is_dir():
        path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), PRIVATE_MODE)  # the umask may have taken bits away; none were ever added
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["PRIVATE_DIR_MODE", "PRIVATE_MODE", "write_private"]
