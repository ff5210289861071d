"""Credit: what each contributor gave the run over the whole run, as the learners count it.

Volunteer-computing projects credit their volunteers; here a contributor is the key whose fingerprint signs its
groups (a rollout peer's ``--identity`` keeps it across restarts). For each, a learner counts the groups its updates
**used**, the groups its intake **refused** (by reason: :data:`peer.roles.learner.verify.REASONS`; a ``duplicate`` is
not counted: it is the learner reading a bucket again after a restart, not the producer's doing), the groups that were
**stale** (read too late, or waited in the pool until they were), the verified groups **without signal** (all
rewards equal), when it was first counted (**since**), and its latest ``--name`` from its heartbeat.

Counts never go down, whatever happens to a learner:

* a learner keeps its :class:`CreditTable` in its checkpoint (``checkpoint.json``: ``credit``) and appends to every
  journal line the entries that changed since the line before (absolute values), so a learner killed between
  checkpoints gets back the counts of every version it journalled (the learner's checkpoint module,
  ``restore_credit``);
* it publishes the table as a :class:`~peer.protocol.CreditRecord` under ``{run}_credit`` (its top
  ``MAX_CREDITED`` contributors by groups used), at most every ``PUBLISH_EVERY`` seconds when something changed and
  every ``REFRESH_EVERY`` seconds anyway (:class:`CreditPublisher`, a thread: the loop never waits on it);
* when it starts, and when it takes a team over as leader, it merges every credit record of an admitted learner it
  can read, per contributor and per count by maximum (:func:`merge_admitted`): a learner restarted without its
  checkpoint, or a helper that becomes leader, starts from what the team last published. Merging by maximum is
  exact when both sides count the same history (a restart: its own record), never adds anything twice, and never
  lowers a count; it can miss what the other side counted in its last seconds (a takeover).

Everything a stranger could inflate is bounded: only admitted learners' records are read (a stranger's is ignored
and named in status); a record lists at most ``MAX_CREDITED`` contributors and ``MAX_CREDIT_REASONS`` reasons each,
counts are capped at ``MAX_CREDIT``, a name is a :class:`~peer.protocol.PeerName`; a learner keeps at most
``MAX_KEPT`` contributors in memory and in its checkpoint (when full, those with the fewest groups used make
room: floods of fresh keys whose groups are all refused cost nothing lasting).

No torch here: status and the host's page read credit records with the same code.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from peer.log import get_logger
from peer.protocol import (
    Credit,
    CreditRecord,
    credit_key,
    key_fingerprint,
    owned_records,
    owner_subkey,
    peer_name_problem,
    to_dht_value,
)
from peer.protocol.limits import MAX_CREDIT, MAX_CREDIT_REASONS, MAX_CREDITED, MAX_INT
from peer.protocol.records import FINGERPRINT_PATTERN, REASON_PATTERN

logger = get_logger(__name__)

MAX_KEPT = 1024  # contributors a learner (or the host) keeps; the published record lists its top MAX_CREDITED
MAX_KEPT_REASONS = 16  # reasons kept per contributor (the intake has 12; merged records may name others)
PUBLISH_EVERY = 5.0  # s between two looks at whether the table changed (then it is published)
REFRESH_EVERY = 60.0  # s after which the record is stored again even unchanged (it lives CREDIT_TTL)
CREDIT_TTL = 600.0  # s a credit record lives unless stored again (quota.MAX_TTL["credit"])
NOT_CREDITED = frozenset({"duplicate"})  # refusals that say nothing about the producer (a re-read after a restart)
COUNTS = ("used", "refused", "stale", "no_signal")
_FINGERPRINT = re.compile(FINGERPRINT_PATTERN)
_REASON = re.compile(REASON_PATTERN)


@dataclass
class Tally:
    """One contributor's counts (see the module docstring)."""

    since: float
    used: int = 0
    refused: int = 0
    stale: int = 0
    no_signal: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    name: str | None = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "used": self.used,
            "refused": self.refused,
            "reasons": dict(self.reasons),
            "stale": self.stale,
            "no_signal": self.no_signal,
            "since": self.since,
        }

    @classmethod
    def from_json(cls, value) -> Tally:
        """A tally from :meth:`to_json` (or a :class:`~peer.protocol.Credit`'s dict); ValueError if malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a tally must be a map, got {type(value).__name__}")
        counts = {k: _count(value.get(k, 0), k) for k in COUNTS}
        reasons = value.get("reasons", {})
        if not isinstance(reasons, dict):
            raise ValueError("reasons must be a map")
        reasons = {str(r): _count(n, f"reasons.{r}") for r, n in reasons.items() if _REASON.match(str(r))}
        since = value.get("since")
        if isinstance(since, bool) or not isinstance(since, int | float) or not 0 <= since < float("inf"):
            raise ValueError(f"since must be a time, got {since!r}")
        name = value.get("name")
        if name is not None and peer_name_problem(name) is not None:
            name = None  # a name that does not display safely is dropped, the counts kept
        tally = cls(since=float(since), name=name, **counts)
        tally.reasons = dict(sorted(reasons.items(), key=lambda rn: -rn[1])[:MAX_KEPT_REASONS])
        return tally

    def merge(self, other: Tally, take_name: bool = False) -> bool:
        """Take, per count, the larger of the two; the earlier ``since``; the other's name if this one has none
        (or ``take_name``: the other's is the newer). Returns whether anything changed."""
        before = self.to_json()
        self.used, self.stale = max(self.used, other.used), max(self.stale, other.stale)
        self.no_signal = max(self.no_signal, other.no_signal)
        for reason, n in other.reasons.items():
            if reason in self.reasons or len(self.reasons) < MAX_KEPT_REASONS:
                self.reasons[reason] = max(self.reasons.get(reason, 0), n)
        self.refused = min(MAX_CREDIT, max(self.refused, other.refused, sum(self.reasons.values())))
        self.since = min(self.since, other.since)
        if other.name is not None and (take_name or self.name is None):
            self.name = other.name
        return self.to_json() != before

    def credit(self) -> Credit:
        """As a record's :class:`~peer.protocol.Credit`: counts capped, the largest reasons that fit ``refused``."""
        refused = min(MAX_CREDIT, self.refused)
        listed: dict[str, int] = {}
        for reason, n in sorted(self.reasons.items(), key=lambda rn: (-rn[1], rn[0]))[:MAX_CREDIT_REASONS]:
            n = min(MAX_CREDIT, n)
            if sum(listed.values()) + n <= refused:
                listed[reason] = n
        return Credit(
            name=self.name,
            used=min(MAX_CREDIT, self.used),
            refused=refused,
            reasons=listed,
            stale=min(MAX_CREDIT, self.stale),
            no_signal=min(MAX_CREDIT, self.no_signal),
            since=self.since,
        )


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a count (an int >= 0), got {value!r}")
    return min(MAX_CREDIT, value)


class CreditTable:
    """Every contributor's :class:`Tally`, bounded to ``max_kept``; thread-safe (the intake counts on the learner's
    loop, the publisher reads on its own thread)."""

    def __init__(self, max_kept: int = MAX_KEPT, clock=time.time):
        self.max_kept = max_kept
        self.clock = clock
        self.tallies: dict[str, Tally] = {}
        self.groups_used = 0  # every contributor's, evicted ones included
        self.changed = False  # since the last record was built
        self.evicted = 0
        self._dirty: set[str] = set()  # fingerprints changed since the last journal delta
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.tallies)

    def get(self, fingerprint: str) -> Tally | None:
        with self._lock:
            tally = self.tallies.get(fingerprint)
            return None if tally is None else Tally.from_json(tally.to_json())

    # --- counting --------------------------------------------------------------------------------------------------

    def count(self, fingerprint: str, what: str, n: int = 1) -> None:
        """Add ``n`` to ``what`` of ``fingerprint``: ``used``, ``stale``, ``no_signal``, or a refusal reason."""
        if n <= 0 or what in NOT_CREDITED:
            return
        with self._lock:
            tally = self._tally(fingerprint)
            if what == "used":
                tally.used = min(MAX_CREDIT, tally.used + n)
                self.groups_used = min(MAX_INT, self.groups_used + n)
            elif what in ("stale", "no_signal"):
                setattr(tally, what, min(MAX_CREDIT, getattr(tally, what) + n))
            else:
                tally.refused = min(MAX_CREDIT, tally.refused + n)
                if what in tally.reasons or len(tally.reasons) < MAX_KEPT_REASONS:
                    tally.reasons[what] = min(MAX_CREDIT, tally.reasons.get(what, 0) + n)
            self._touched(fingerprint)

    def count_used(self, used_by_owner: dict[str, list]) -> None:
        """An update's groups (an intake delta's ``used``: owner key hex -> ``[[seq, version], ...]``)."""
        for owner_hex, pairs in used_by_owner.items():
            self.count(key_fingerprint(bytes.fromhex(owner_hex)), "used", len(pairs))

    def set_names(self, names: dict[str, str]) -> None:
        """The latest ``--name`` of contributors this table counts (from their heartbeats); others are ignored."""
        with self._lock:
            for fingerprint, name in names.items():
                tally = self.tallies.get(fingerprint)
                if tally is not None and name and tally.name != name and peer_name_problem(name) is None:
                    tally.name = name
                    self._touched(fingerprint)

    # --- merging ---------------------------------------------------------------------------------------------------

    def merge(self, tallies: dict[str, Tally], groups_used: int = 0, take_names: bool = False) -> int:
        """Merge other counts per contributor by maximum (``take_names``: their names are the newer); returns how
        many contributors changed."""
        changed = 0
        with self._lock:
            for fingerprint, other in tallies.items():
                if not _FINGERPRINT.match(fingerprint):
                    continue
                if self._tally(fingerprint, since=other.since).merge(other, take_names):
                    self._touched(fingerprint)
                    changed += 1
            used = max(groups_used, sum(t.used for t in self.tallies.values()))
            if used > self.groups_used:
                self.groups_used, self.changed = min(MAX_INT, used), True
        return changed

    def merge_record(self, record: CreditRecord) -> int:
        return self.merge({fp: Tally.from_json(c.dict()) for fp, c in record.contributors.items()}, record.groups_used)

    # --- persistence -----------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Every contributor kept (for a checkpoint or the host's state file)."""
        with self._lock:
            return {
                "groups_used": self.groups_used,
                "contributors": {fp: t.to_json() for fp, t in self.tallies.items()},
            }

    def take_delta(self) -> dict:
        """The contributors changed since the last call, with their whole (absolute) counts: a journal line's."""
        with self._lock:
            delta = {fp: self.tallies[fp].to_json() for fp in self._dirty if fp in self.tallies}
            self._dirty.clear()
            return {"groups_used": self.groups_used, "contributors": delta}

    def load(self, value, what: str) -> int:
        """Merge a :meth:`to_json` / :meth:`take_delta` value read from a file; entries that do not parse are
        skipped (logged once per call, naming ``what``). Returns how many contributors it held."""
        if not isinstance(value, dict) or not isinstance(value.get("contributors", {}), dict):
            logger.warning("ignoring the credit in %s: not a credit table", what)
            return 0
        tallies, bad = {}, 0
        for fingerprint, entry in value.get("contributors", {}).items():
            try:
                if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
                    raise ValueError(f"{fingerprint!r} is not a key fingerprint")
                tallies[fingerprint] = Tally.from_json(entry)
            except ValueError:
                bad += 1
        if bad:
            logger.warning("ignoring %d unreadable credit entr%s in %s", bad, "y" if bad == 1 else "ies", what)
        used = value.get("groups_used", 0)
        self.merge(tallies, used if isinstance(used, int) and not isinstance(used, bool) and used >= 0 else 0)
        return len(tallies)

    # --- reading ---------------------------------------------------------------------------------------------------

    def ranked(self) -> list[tuple[str, Tally]]:
        """Contributors by groups used (then by groups made at all, then the earliest), copies."""
        with self._lock:
            items = [(fp, Tally.from_json(t.to_json())) for fp, t in self.tallies.items()]
        return sorted(
            items, key=lambda ft: (-ft[1].used, -(ft[1].refused + ft[1].stale + ft[1].no_signal), ft[1].since, ft[0])
        )

    def record(self, learner: str, version: int) -> CreditRecord:
        """The table as this learner's record: its top ``MAX_CREDITED`` contributors by groups used."""
        top = self.ranked()[:MAX_CREDITED]
        contributors = {fp: tally.credit() for fp, tally in top}
        with self._lock:
            self.changed = False
            known, total = len(self.tallies), self.groups_used
        return CreditRecord(
            learner=learner,
            version=version,
            groups_used=max(total, sum(c.used for c in contributors.values())),
            contributors_known=max(known, len(contributors)),
            contributors=contributors,
            created=time.time(),
        )

    # --- internals (lock held) -------------------------------------------------------------------------------------

    def _tally(self, fingerprint: str, since: float | None = None) -> Tally:
        tally = self.tallies.get(fingerprint)
        if tally is None:
            if len(self.tallies) >= self.max_kept:
                self._make_room()
            tally = self.tallies[fingerprint] = Tally(since=self.clock() if since is None else since)
        return tally

    def _make_room(self) -> None:
        """Drop the eighth of the table with the fewest groups used (then the least made), oldest first."""
        keep = self.max_kept - max(1, self.max_kept // 8)
        ranked = sorted(
            self.tallies.items(), key=lambda ft: (-ft[1].used, -(ft[1].refused + ft[1].stale + ft[1].no_signal))
        )
        for fingerprint, _ in ranked[keep:]:
            del self.tallies[fingerprint]
            self._dirty.discard(fingerprint)
            self.evicted += 1

    def _touched(self, fingerprint: str) -> None:
        self._dirty.add(fingerprint)
        self.changed = True


# ---------------------------------------------------------------------------------------------------- the DHT


def read_credits(swarm) -> list[tuple[bytes, CreditRecord]]:
    """Every well-formed credit record under ``{run}_credit``, with its signer (admitted or not: see
    :func:`admitted_credits`)."""
    return owned_records(swarm.get_dict(credit_key(swarm.run_id)), CreditRecord)


def admitted_credits(swarm, admitted) -> list[tuple[bytes, CreditRecord]]:
    """The credit records of admitted learners (``admitted``: :class:`~peer.network.admission.Admitted`), each
    signed by the learner whose credential is bound to the record's ``learner`` peer id. A stranger's record is
    ignored (and named in ``admitted.refused``, for status)."""
    kept = []
    for signer, record in read_credits(swarm):
        if admitted.admits(signer, record.learner):
            kept.append((signer, record))
        else:
            admitted.refuse(signer, "publishes a credit record without being an admitted learner")
    return kept


def merge_admitted(table: CreditTable, swarm, admitted) -> int:
    """Merge every admitted learner's credit record into ``table`` (by maximum); returns how many were read."""
    records = admitted_credits(swarm, admitted)
    changed = sum(table.merge_record(record) for _, record in records)
    if records:
        logger.info(
            "merged the credit of %d admitted learner record(s): %d contributor(s) raised, %d known",
            len(records),
            changed,
            len(table),
        )
    return len(records)


def merged(records: list[CreditRecord]) -> CreditTable:
    """One table from several learners' records (by maximum): what status and the host show."""
    table = CreditTable(max_kept=MAX_KEPT)
    for record in records:
        table.merge_record(record)
    return table


def heartbeat_names(swarm) -> dict[str, str]:
    """Key fingerprint -> ``--name`` of every live peer that gave one."""
    from peer.network.heartbeat import live_peers

    return {key_fingerprint(p.owner): p.record.name for p in live_peers(swarm) if p.record.name}


class CreditPublisher:
    """Publishes a learner's :class:`CreditTable` from a thread: looks every ``every`` seconds, stores the record
    when the table changed (names from the heartbeats included) or ``refresh`` seconds went by; never on the
    learner's loop. Names are read from the heartbeats (a table that grows with the number of peers) once per
    ``refresh`` only."""

    def __init__(
        self,
        swarm,
        table: CreditTable,
        version,
        *,
        every: float = PUBLISH_EVERY,
        refresh: float = REFRESH_EVERY,
        ttl: float = CREDIT_TTL,
    ):
        self.swarm, self.table, self.version = swarm, table, version  # version: () -> the adapter version held
        self.every, self.refresh, self.ttl = every, refresh, ttl
        self.published = 0
        self.failures = 0
        self._stored_at = -float("inf")
        self._named_at = -float("inf")  # names are read from every peer's heartbeat: once per refresh at most
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="credit-publisher", daemon=True)

    def start(self) -> CreditPublisher:
        self._thread.start()
        return self

    def publish(self, force: bool = False) -> bool:
        """Store the record now if it changed (or ``force``, or it is due for a refresh); True if stored."""
        if not len(self.table):
            return False
        if force or time.monotonic() - self._named_at >= self.refresh:
            self._named_at = time.monotonic()
            self.table.set_names(heartbeat_names(self.swarm))
        if not (force or self.table.changed or time.monotonic() - self._stored_at >= self.refresh):
            return False
        record = self.table.record(str(self.swarm.peer_id), max(0, self.version()))
        stored = self.swarm.store(
            credit_key(self.swarm.run_id),
            owner_subkey(self.swarm.public_key),
            to_dht_value(record),
            time.time() + self.ttl,
            "credit record",
        )
        if stored:
            self._stored_at = time.monotonic()
            self.published += 1
        else:
            self.table.changed = True  # try again at the next look
        return bool(stored)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.publish()
            except Exception as e:  # the network boundary: keep counting, try again at the next look
                self.failures += 1
                self.table.changed = True
                logger.warning("could not publish the credit record: %s", e)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every + 30)
        try:
            self.publish(force=True)
        except Exception as e:  # leaving: the record published last stays until it expires
            logger.warning("could not publish the last credit record: %s", e)


# ---------------------------------------------------------------------------------------------------- for people


def contributor_rows(table: CreditTable, names: dict[str, str] | None = None) -> list[dict]:
    """The table as JSON-ready rows, most groups used first: what ``hivegrpo status --contributors`` and the host's
    page show. ``names``: the newest names from live heartbeats (they win over the table's)."""
    names = names or {}
    ranked = table.ranked()
    total = max(table.groups_used, sum(t.used for _, t in ranked)) or 0
    return [
        {
            "fingerprint": fp,
            "name": names.get(fp) or t.name,
            "used": t.used,
            "refused": t.refused,
            "reasons": dict(sorted(t.reasons.items(), key=lambda rn: (-rn[1], rn[0]))),
            "stale": t.stale,
            "no_signal": t.no_signal,
            "share": round(t.used / total, 4) if total else 0.0,
            "since": t.since,
        }
        for fp, t in ranked
    ]


def merge_rows(table: CreditTable, rows: list[dict]) -> int:
    """Merge :func:`contributor_rows` (what status read now: their names are the newest) into ``table``."""
    tallies = {}
    for row in rows:
        try:
            tallies[row["fingerprint"]] = Tally.from_json(row)
        except (KeyError, TypeError, ValueError):
            continue
    return table.merge(tallies, take_names=True)


__all__ = [
    "CREDIT_TTL",
    "MAX_KEPT",
    "CreditPublisher",
    "CreditTable",
    "Tally",
    "admitted_credits",
    "contributor_rows",
    "heartbeat_names",
    "merge_admitted",
    "merged",
    "read_credits",
    "merge_rows",
]
