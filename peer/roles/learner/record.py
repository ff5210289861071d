"""What a learner keeps of each update: :class:`VersionRecord`, the line of its ``--ledger``, the entry of its history
(heartbeat, metrics, throughput) and the ``record`` of a team step (a helper keeps its leader's)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class VersionRecord:
    version: int  # the version the update made (for an update without signal: the version it left as it was)
    sha256: str
    parent_sha256: str | None  # None: an update without signal (no version made)
    time: float  # wall clock when it was recorded
    groups: int  # groups the update used
    staleness_mean: float
    staleness_max: int
    reward_mean: float
    step_seconds: float
    waiting: int = 0  # groups waiting in the intake then
    dropped_stale: int = 0  # the intake's counts so far
    dropped_no_signal: int = 0
    no_signal_share: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)
    banned: list[str] = field(default_factory=list)  # key fingerprints
    per_peer: dict[str, int] = field(default_factory=dict)  # key fingerprint -> groups it gave this update
    stats: dict[str, Any] | None = None  # the step's (loss, clip fraction, ratio, grad norm, busy, helpers, …)

    @property
    def no_signal(self) -> bool:
        """Every group's rewards were equal: the groups are used, the adapter did not move."""
        return self.stats is None

    def to_json(self) -> dict:
        """The ledger's line: the fields, then the step's statistics (or ``"no_signal": true``) at the top level."""
        line = asdict(self)
        stats = line.pop("stats")
        return {**line, **(stats if stats is not None else {"no_signal": True})}

    @classmethod
    def from_json(cls, line: dict) -> VersionRecord:
        """A record from its ledger line (a leader's, in a team step, checked by the step's schema for size only).
        Raises ``ValueError`` when a field is missing or not a number where one must be."""
        names = {f.name for f in fields(cls)} - {"stats"}
        try:
            record = cls(
                **{k: v for k, v in line.items() if k in names},
                stats=None if line.get("no_signal") else {k: v for k, v in line.items() if k not in names},
            )
            numbers = (record.version, record.time, record.groups, record.staleness_mean, record.reward_mean)
            numbers += (record.staleness_max, record.step_seconds)
            if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
                raise TypeError("a field that must be a number is not one")
        except TypeError as e:
            raise ValueError(f"not a version record: {e}") from e
        return record


__all__ = ["VersionRecord"]
