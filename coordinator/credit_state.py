"""The host's contributors table: the credit it last saw, kept on disk so a restarted host shows it at once.

The host reads the learners' credit records with every status reading (:func:`peer.status.read_status`: admitted
learners only, merged by maximum) and merges them into the table it keeps, by maximum too, so its counts never go
down: not when the learners restart, not when their records expire while none runs, not when the host restarts.
The table is written (atomically) whenever it changed, beside ``--identity`` (``IDENTITY.RUN.credit.json``) or, without
one, in the cache folder under the coordinator's key fingerprint. A file that does not parse is set aside with one
warning (renamed ``.bad``) and the table starts from what the swarm publishes.
"""

from __future__ import annotations

import json
from pathlib import Path

from peer.log import get_logger
from peer.run.credit import CreditTable, contributor_rows, merge_rows

logger = get_logger(__name__)


class CreditState:
    """The contributors table of run ``run_id`` kept in ``path`` (None: in memory only)."""

    def __init__(self, path: Path | None, run_id: str):
        self.path = path
        self.run_id = run_id
        self.table = CreditTable()
        self.saves = 0
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("run_id") != self.run_id:
                raise ValueError(f"it is not run {self.run_id}'s credit")
        except (OSError, ValueError) as e:
            aside = path.with_suffix(path.suffix + ".bad")
            logger.warning("the credit table in %s is unreadable (%s); moved to %s, starting anew", path, e, aside)
            path.replace(aside)
            return
        n = self.table.load(data.get("credit"), str(path))
        self.table.changed = False
        logger.info("showing the credit of %d contributor(s) kept in %s", n, path)

    def update(self, status: dict) -> dict:
        """Merge what ``status`` read now into the kept table; ``status``'s contributors become the table's."""
        names = {p["fingerprint"]: p["name"] for p in status.get("peers", []) if p.get("name")}
        merge_rows(self.table, status.get("contributors", []))
        self.table.merge({}, status.get("groups_used_total", 0))
        self.table.set_names(names)  # the latest name known: a heartbeat's now, else the one kept
        if self.table.changed:
            self._save()
        rows = contributor_rows(self.table, names)
        known = max(len(rows), status.get("contributors_known", 0))
        return status | {
            "contributors": rows,
            "contributors_known": known,
            "groups_used_total": self.table.groups_used,
        }

    def _save(self) -> None:
        self.table.changed = False
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "credit": self.table.to_json()}))
        tmp.replace(self.path)
        self.saves += 1


__all__ = ["CreditState"]
