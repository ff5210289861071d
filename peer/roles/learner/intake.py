"""A learner's intake: what it does with every group it reads, before anything learns from it.

Pure logic over :class:`~peer.network.buckets.Fetched` entries (no model, no network), so every rule is unit-tested
with an in-memory bucket store. For each entry, in order:

1. a signer already **banned** is ignored (counted, never looked at again);
2. an entry that did not parse is refused as ``schema`` (not banned: a blob may have been cut in transit), until
   a signer has more of them in a row than the strike limit below (an inline entry's groups are signed bytes
   that only learners parse, ``peer.protocol.groups_of``: a signer flooding unreadable ones is banned, not
   parsed forever). A blob that could not be fetched (its producer did not answer in time: behind a firewall,
   gone, or a stranger naming providers that never serve) proves nothing against the signer: it is refused as
   ``unavailable``, never strikes and never bans; but each costs a fetch worker a timeout, so the signer is
   **muted** — its entries are not read — for ``MUTE_FIRST`` s, twice as long each time it is muted again with no
   verified group between (at most ``MUTE_MOST`` s). The entries it writes while muted are never read;
3. a ``seq`` the signer already used under another adapter version is a **replay**: refused, signer banned; the
   same entry read twice (same version and seq, e.g. again after a restart) is a ``duplicate``, refused and
   forgiven: it is never used twice. The seqs of versions that left the window are forgotten, keeping only the
   highest (the signer's *floor*): an honest peer numbers its groups in the order it samples them, with versions
   that never go back, so a group inside the window whose seq is at or below the floor was re-tagged — a replay;
   one outside it is stale anyway. The memory of seqs is so bounded by the window, not by the run's length;
4. a group more than ``tau_max`` versions behind is dropped as stale;
5. :func:`~peer.roles.learner.verify.check_group` (shape, vocabulary, adapter version + sha256, the prompt
   re-derived from the signer's seed and seq, every reward recomputed): a refusal bans the signer — except an
   adapter version this learner does not know, refused as ``unknown_version`` (it may come from before a restart),
   and a version whose sha256 is not this lineage's, refused as ``lineage`` (made under a version of a learner
   that lost the lead): both forgiven — until a signer has more of them in a row (no verified group in between)
   than ``STRIKE_UPDATES`` updates' worth of the staleness window: an honest peer follows the lineage within a
   few batches, one that keeps sending such groups floods the learner and is banned;
6. a group whose rewards are all equal carries no advantage (GRPO's signal is the spread within a group): it
   is counted (``no_signal``; :meth:`Intake.no_signal_share` for status) and never takes one of an update's
   slots, which go to groups that teach something (DAPO's and INTELLECT-2's online filtering). Its rewards were
   recomputed by step 5; its log-probs are never checked, as they never reach a loss;
7. a sample (``check_rate``, drawn from this learner's private randomness, so a producer cannot predict it) waits for
   the caller to recompute its behaviour log-probs (:meth:`Intake.pending_checks` / :meth:`Intake.checked`); the rest
   are admitted to the pool. A signer **on probation** — fewer than ``PROBATION`` of its groups passed a check or went
   into an update — has *every* group with signal checked before it is pooled: keys are free, so a sampled check alone
   let a forger with many keys have ~90 % of its groups used before each key's first check (docs/reliability.md,
   "Sybils"); now a forged group of a fresh key is caught before any update sees it. Groups of signers on probation are
   checked within a budget, renewed at every update (at most ``max(batch, PROBATION)`` of one signer,
   ``PROBATION_BUDGET x batch`` of all such signers together); beyond it they are refused as ``busy`` (forgiven, never
   banned): a flood of fresh keys costs the learner a bounded number of forward passes per update and delays other
   newcomers' first groups, never a proven producer's. With ``check_rate`` 0 (log-prob checks off) there is no
   probation either.

A ban removes the signer's groups from the pool at once: nothing a liar sent after it was caught reaches an
update, and nothing it sent at all when the lie is in its first groups (the usual case).

:meth:`Intake.take` picks the next update's groups, freshest first, with a **per-peer cap**: no signer provides more
than ``cap = ceil(max(share_cap, 1 / contributors) x n)`` of the ``n`` groups per update *on average*, where
*contributors* are the signers one of whose groups **with signal** was pooled (verified, and checked where drawn) in
the staleness window, in the last ``recent`` seconds. A signer of groups without signal contributes nothing an update
can use, so it never counts: counting it let one stranger key with one all-wrong group every 15 s cap a lone honest
producer below a full update for ever, and pace every producer down (the learner's demand divides by the contributors).
The cap is a token bucket: each update gives every signer ``cap`` tokens, a group taken costs one, and a signer holds
at most ``cap + ceil(cap x BURST)`` (where it starts). So over any ``m`` updates a signer gives at most ``m x cap +
ceil(cap x BURST)`` groups, and one update at most ``cap + ceil(cap x BURST)``: the long-run share is the cap's, while
an update need not wait for a producer whose batch is a moment late when another has groups to lend (it pays them back
in the updates that follow). A cap held update by update made an update wait for each producer's next batch even with
groups to spare (docs/learner.md, "The per-peer cap"). One peer alone may fill an update; with two or more, a flooding
peer is held to its cap and the update waits for the others — but not for peers that died or hang: they stop counting
``recent`` seconds after their last group (counting versions alone, an update waiting for a dead peer would wait
forever, since no new version moves the window). The pool keeps at most ``n x (tau_max + 1)`` groups per signer (the
oldest surplus is dropped), so a flood cannot grow the learner's memory.

``barrier`` (a benchmark knob, docs/benchmarks.md) makes :meth:`Intake.take` a synchronous barrier's: an update
waits until every contributor has ``ceil(n / contributors)`` groups sampled with the learner's current version, and
takes exactly that many of each (the baseline the asynchronous intake is measured against).

With ``credit`` set (a :class:`~peer.run.credit.CreditTable`), every refusal (by reason, ``duplicate`` aside),
stale group and group without signal is also counted for its signer, over the whole run: the contributors' credit.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass

from peer.network.buckets import Fetched
from peer.protocol import GroupRecord, key_fingerprint
from peer.roles.learner.verify import (
    REWARD_TOLERANCE,
    Refused,
    check_group,
    group_evidence,
    judge_improbable,
    judge_signer,
)
from peer.run.spec import RunSpec

FORGIVEN = ("schema", "unavailable", "duplicate", "unknown_version", "lineage", "surplus", "busy")
"""Refusal reasons that do not ban the signer."""
STRIKES = ("unknown_version", "lineage", "schema")
"""Forgiven reasons that still count towards a ban when they come in a long run from one signer."""
STRIKE_UPDATES = 4  # such refusals in a row that ban: this many times groups_per_version x (tau_max + 1)
BURST = 0.5  # the share of its cap a signer may give beyond it in one update, paid back in the next ones
MUTE_FIRST = 10.0  # s a signer whose blob could not be fetched is muted, the first time since its last verified group
MUTE_MOST = 600.0  # s: each mute again with no verified group between lasts twice the last, up to this
PROBATION = 8  # groups of a signer that must pass a check (or go into an update) before checks are only sampled
MAX_BANS = 4096  # banned signers remembered (the most recent): a forgotten one is on probation again, caught anew
MAX_WRITTEN = 4096  # signers whose improbable tokens in updates are summed (the most recently used)
PROBATION_BUDGET = 2  # x batch: groups of all signers on probation checked per update (or per ``recent`` s), at most
FORGET_MARGIN = 2  # versions beyond the window whose seqs are still remembered one by one
FORGET_EVERY = 8  # versions between two passes that forget old seqs
RECENT_SIGNAL = 512  # verified groups over which the share without signal is reported
MAX_SIGNER_STATE = 4096  # signers whose refusals, strikes and mutes are kept (the most recent): keys are free
MAX_FLOORS = 1 << 15  # signers whose floor (and used seqs, in checkpoints and team states) are kept, the most recent


class RecentCounts(OrderedDict):
    """Signer -> count, for the ``cap`` signers counted most recently: a count a flood of fresh keys cannot grow
    without bound (each key's first refusal would otherwise add an entry for good). Reads of others give 0."""

    def __init__(self, cap: int = MAX_SIGNER_STATE):
        super().__init__()
        self.cap = cap

    def __missing__(self, key) -> int:
        return 0

    def add(self, key, n: int = 1) -> int:
        self[key] = self.get(key, 0) + n
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)
        return self[key]


def carries_signal(rewards) -> bool:
    """Whether a verified group's rewards differ (GRPO's advantage is their spread). Each claimed reward is within
    ``REWARD_TOLERANCE`` of the recomputed one, so a smaller spread may be a claim's rounding, not signal."""
    return max(rewards) - min(rewards) > 2 * REWARD_TOLERANCE


@dataclass(frozen=True)
class Accepted:
    """A verified group waiting for an update, with the key that signed it."""

    owner: bytes
    group: GroupRecord

    @property
    def id(self) -> tuple[str, int, int]:
        return (key_fingerprint(self.owner), self.group.version, self.group.seq)


class Intake:
    """Verification, bans, replay detection, the pool and the per-peer cap (see the module docstring)."""

    def __init__(
        self,
        spec: RunSpec,
        tokenizer,
        *,
        batch: int,
        share_cap: float = 0.5,
        check_rate: float = 0.1,
        rng: random.Random | None = None,
        recent: float = 15.0,
        clock=time.monotonic,
        barrier: bool = False,
    ):
        if not 0.0 < share_cap <= 1.0:
            raise ValueError(f"share_cap must be in (0, 1], got {share_cap}")
        if not 0.0 <= check_rate <= 1.0:
            raise ValueError(f"check_rate must be in [0, 1], got {check_rate}")
        self.spec = spec
        self.tokenizer = tokenizer
        self.batch = batch
        self.share_cap = share_cap
        self.check_rate = check_rate
        self.rng = rng or random.Random(os.urandom(16))
        self.recent, self.clock = recent, clock
        self.barrier = barrier
        self.known: dict[int, str] = {}  # adapter version -> sha256 of this learner's lineage
        self.banned: OrderedDict[bytes, str] = OrderedDict()  # signer -> why (the MAX_BANS most recent)
        self.written: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # signer -> its groups' improbable
        # tokens in updates and the count sampling would give (the MAX_WRITTEN most recently used signers)
        self.bans_made = 0  # bans ever made here (or restored): ``banned`` keeps their order, forgetting the oldest
        self.seqs: dict[bytes, dict[int, int]] = defaultdict(dict)  # signer -> seq -> version (recent versions)
        self.floor: OrderedDict[bytes, int] = OrderedDict()  # signer -> the highest seq forgotten (its version left
        # the window), the MAX_FLOORS most recently forgotten
        self.used: dict[bytes, dict[int, int]] = defaultdict(dict)  # the same, of groups an update took
        self.pool: dict[bytes, list[Accepted]] = defaultdict(list)
        self.tokens: dict[bytes, int] = {}  # signer -> groups it may give to the next update, when below the most
        self.last_verified: dict[bytes, int] = {}  # signer -> newest version of a pooled group (with signal)
        self.last_arrival: dict[bytes, float] = {}  # signer -> clock() when its latest pooled group was pooled
        self.proven: dict[bytes, int] = {}  # signer -> its groups that passed a check or went into an update
        self._probation_spent: Counter = Counter()  # signer on probation -> groups let into checks since the renewal
        self._probation_since = clock()
        self._pending: list[Accepted] = []
        self.pending_since = 0.0  # clock() when the oldest group now waiting for a check was drawn
        self.counts: Counter = Counter()  # ignored_banned, dropped_stale, checked, admitted
        self.rejected: Counter = Counter()  # reason -> groups
        self.rejected_by = RecentCounts()  # signer -> groups refused (the MAX_SIGNER_STATE most recent)
        self.strikes = RecentCounts()  # signer -> STRIKES refusals since its last verified group
        self.muted: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # signer -> (clock() its mute ends, how
        # long it lasted), the MAX_SIGNER_STATE most recently muted
        self.skipped = Skipped(self)  # signers whose entries are not read now: banned or muted (a live view)
        self.newcomers = Newcomers(self)  # signers on probation (a live view)
        self._forgotten_at = 0  # the learner's version at the last forget()
        self.recent_signal: deque[bool] = deque(maxlen=RECENT_SIGNAL)  # of the latest verified groups: signal?
        self.arrival_lag: Counter = Counter()  # versions behind the learner's when read (tau_max + 1: more)
        self.credit = None  # a peer.run.credit.CreditTable: what happened to each signer's groups, over the run

    # --- reading ---------------------------------------------------------------------------------------------------

    def add(self, fetched: Fetched, version: int) -> str | None:
        """Take one entry read from a bucket while the learner holds ``version``.

        Returns None (verified, waiting for an update or a log-prob check), ``"no_signal"`` (verified, but its rewards
        are all equal: it carries no advantage and is counted, not kept), ``"banned"`` (its signer is), ``"stale"``,
        or the :class:`Refused` sentence.
        """
        owner = fetched.owner
        if owner in self.banned:
            self.counts["ignored_banned"] += 1
            return "banned"
        if fetched.group is None and fetched.unavailable:
            return self._unavailable(owner, Refused("unavailable", fetched.error or "group blob unavailable"))
        if fetched.group is None:
            return self._refuse(owner, Refused("schema", fetched.error or "unreadable entry"))
        group = fetched.group
        seen = self.seqs[owner].get(group.seq)
        if seen == group.version:
            return self._refuse(owner, Refused("duplicate", f"group {group.version}.{group.seq} was read already"))
        if seen is not None:
            return self._refuse(
                owner, Refused("replay", f"seq {group.seq} was already published by this signer, with v{seen}")
            )
        stale = version - group.version > self.spec.staleness.tau_max
        self.arrival_lag[min(max(0, version - group.version), self.spec.staleness.tau_max + 1)] += 1
        if group.seq <= self.floor.get(owner, -1) and not stale:
            return self._refuse(
                owner,
                Refused(
                    "replay", f"seq {group.seq} is at or below seqs this signer published with versions long gone"
                ),
            )
        self.seqs[owner][group.seq] = group.version
        if stale:
            self.counts["dropped_stale"] += 1
            self.counts["stale_on_arrival"] += 1
            self._credit(owner, "stale")
            return "stale"
        if group.version not in self.known:
            return self._refuse(owner, Refused("unknown_version", f"adapter v{group.version} is not in this lineage"))
        refused = check_group(group, owner, self.spec, self.tokenizer, self.known.get)
        if refused is not None:
            return self._refuse(owner, refused)
        self.strikes.pop(owner, None)
        self.muted.pop(owner, None)
        signal = carries_signal(group.rewards)
        self.recent_signal.append(signal)
        if not signal:  # all rewards equal (and recomputed): no advantage, nothing to learn; never takes a slot
            self.counts["no_signal"] += 1
            self._credit(owner, "no_signal")
            return "no_signal"
        accepted = Accepted(owner, group)
        if self.on_probation(owner):
            busy = self._probation_full(owner)
            if busy is not None:
                return self._refuse(owner, Refused("busy", busy))
            self._wait_for_check(accepted)
        elif self.check_rate and self.rng.random() < self.check_rate:
            self._wait_for_check(accepted)
        else:
            self._admit(accepted)
        return None

    def on_probation(self, owner: bytes) -> bool:
        """Whether every group with signal of ``owner`` is checked before it is pooled (module docstring, step 7)."""
        return self.check_rate > 0 and self.proven.get(owner, 0) < PROBATION

    def _probation_full(self, owner: bytes) -> str | None:
        """Why a group of ``owner`` (on probation) cannot be checked now, or None if it can (then it is counted).

        Checks cost the learner a forward pass each, so those of signers on probation have a budget: ``batch`` groups
        of one signer (``PROBATION`` if more) and ``PROBATION_BUDGET x batch`` of all of them together, renewed at
        every update and every ``recent`` seconds (a learner waiting for its first update still lets newcomers in)."""
        now = self.clock()
        if now - self._probation_since >= self.recent:
            self._renew_probation()
        mine, spent = self._probation_spent[owner], sum(self._probation_spent.values())
        if mine >= max(self.batch, PROBATION):
            return (
                f"{mine} groups of this new signer are being checked already; its others are refused until it has "
                "passed its checks"
            )
        if spent >= PROBATION_BUDGET * self.batch:
            return f"{spent} groups of new signers are being checked already; send again later"
        self._probation_spent[owner] += 1
        return None

    def _renew_probation(self) -> None:
        self._probation_since = self.clock()
        self._probation_spent.clear()

    def _wait_for_check(self, accepted: Accepted) -> None:
        if not self._pending:
            self.pending_since = self.clock()
        self._pending.append(accepted)

    def no_signal_share(self) -> float:
        """Of the latest verified groups, the share whose rewards were all equal (the task's difficulty signal: near
        1 the task is too easy or too hard for the policy now)."""
        return sum(not s for s in self.recent_signal) / len(self.recent_signal) if self.recent_signal else 0.0

    def checks_waiting(self) -> int:
        return len(self._pending)

    def pending_checks(self) -> list[Accepted]:
        """Groups drawn for a log-prob check (then pass each to :meth:`checked`)."""
        pending, self._pending = self._pending, []
        return [a for a in pending if a.owner not in self.banned]

    def recheck(self, accepted: list[Accepted]) -> None:
        """Groups handed out by :meth:`pending_checks` and not judged (their checker is gone): due again."""
        if accepted and not self._pending:
            self.pending_since = self.clock()
        self._pending.extend(accepted)

    def checked(self, accepted: Accepted, refused: Refused | None) -> None:
        self.counts["checked"] += 1
        if refused is not None:
            self._refuse(accepted.owner, refused)
        elif accepted.owner not in self.banned:
            self.prove(accepted.owner)
            self._admit(accepted)

    def prove(self, owner: bytes, n: int = 1) -> None:
        """Count ``n`` of ``owner``'s groups as verified (a check passed, an update took it, a checkpoint says so):
        ``PROBATION`` of them end its probation."""
        if self.proven.get(owner, 0) < PROBATION:
            self.proven[owner] = min(PROBATION, self.proven.get(owner, 0) + n)

    def refuse_written(self, taken: list[Accepted], evidence) -> list[tuple[Accepted, Refused]]:
        """Refuse what of ``taken`` (one update's share, in order) was written, not sampled: a group whose
        completions hold far more tokens below the run's ``token_floor`` than sampling gives, or whose signer's groups
        in updates do, summed (``evidence``: ``Share.evidence`` of their update's own forward; None when the floor is
        off). Their signers are banned, as a refusal at reading would ban them; the update itself learned nothing
        from those tokens. Returns what was refused."""
        if evidence is None:
            return []
        floor, refused = self.spec.loss.token_floor, []
        for a, (observed, expected) in zip(
            taken, group_evidence(evidence, self.spec.sampling.group_size), strict=True
        ):
            if a.owner in self.banned:
                continue
            verdict = judge_improbable(observed, expected, floor)
            if verdict is None:
                seen, predicted = self.written.pop(a.owner, (0, 0.0))
                seen, predicted = seen + observed, predicted + expected
                self.written[a.owner] = (seen, predicted)
                while len(self.written) > MAX_WRITTEN:
                    self.written.popitem(last=False)
                verdict = judge_signer(seen, predicted, floor)
            if verdict is not None:
                self._refuse(a.owner, verdict)
                refused.append((a, verdict))
        return refused

    def ban(self, owner: bytes, reason: str) -> None:
        """Ban ``owner`` for the run. Keys are free, so the list keeps the ``MAX_BANS`` most recent: a signer
        forgotten is a new one again, on probation (every group checked before use), so its next lie is caught at its
        first group — which costs it a checked group, as a new key would."""
        if owner not in self.banned:
            self.banned[owner] = reason
            self.bans_made += 1
            while len(self.banned) > MAX_BANS:
                self.banned.popitem(last=False)
                self.counts["bans_forgotten"] += 1
            self.strikes.pop(owner, None)
            self.muted.pop(owner, None)
            self.counts["purged"] += len(self.pool.pop(owner, []))
            self.last_verified.pop(owner, None)
            self.last_arrival.pop(owner, None)
            self.tokens.pop(owner, None)
            self.proven.pop(owner, None)
            self.written.pop(owner, None)

    # --- the next update -------------------------------------------------------------------------------------------

    def drop_stale(self, version: int) -> None:
        oldest = version - self.spec.staleness.tau_max
        for owner, groups in list(self.pool.items()):
            kept = [a for a in groups if a.group.version >= oldest]
            self.counts["dropped_stale"] += len(groups) - len(kept)
            self._credit(owner, "stale", len(groups) - len(kept))
            groups[:] = kept
            if not kept:
                del self.pool[owner]
        self.forget_window(version)

    def forget_window(self, version: int) -> None:
        """The lineage is at ``version``: every ``FORGET_EVERY`` versions, :meth:`forget` what left the window (a
        helper, which takes nothing, calls this as it applies the leader's steps)."""
        if version >= self._forgotten_at + FORGET_EVERY:
            self._forgotten_at = version
            self.forget(version - self.spec.staleness.tau_max - FORGET_MARGIN)

    def forget(self, before: int) -> None:
        """Forget the seqs of versions older than ``before``, keeping each signer's highest as its floor; and the
        used ones but each signer's highest (a checkpoint or team state still carries its floor: :meth:`restore`
        puts it back among the seqs, the next forget makes it the floor). What updates used is then bounded by the
        window, not by the run's length: checkpoints and team states no longer grow with every group."""
        for owner, seqs in list(self.seqs.items()):
            old = [s for s, v in seqs.items() if v < before]
            if old:
                self.floor[owner] = max(self.floor.get(owner, -1), *old)
                self.floor.move_to_end(owner)
                for s in old:
                    del seqs[s]
            if not seqs:
                del self.seqs[owner]  # its floor says what it needs to
        while len(self.floor) > MAX_FLOORS:
            self.floor.popitem(last=False)
        for used in self.used.values():
            old = sorted(s for s, v in used.items() if v < before)
            for s in old[:-1]:  # the highest stays: it is the floor a restored intake knows
                del used[s]
        for owner in [o for o, v in self.last_verified.items() if v < before]:  # no longer contributing
            del self.last_verified[owner], self.last_arrival[owner]
        if len(self.used) > MAX_FLOORS:  # the signers whose newest used group is the oldest go first
            newest = sorted(self.used, key=lambda owner: max(self.used[owner].values(), default=-1))
            for owner in newest[: len(self.used) - MAX_FLOORS]:
                del self.used[owner]

    def contributing(self, version: int) -> list[bytes]:
        """Signers with a group with signal pooled in the staleness window in the last ``recent`` seconds."""
        oldest, since = version - self.spec.staleness.tau_max, self.clock() - self.recent
        return [o for o, v in self.last_verified.items() if v >= oldest and self.last_arrival[o] >= since]

    def contributors(self, version: int) -> int:
        return len(self.contributing(version))

    def cap(self, version: int) -> int:
        """The most groups one signer may give to the next update."""
        share = max(self.share_cap, 1.0 / max(1, self.contributors(version)))
        return max(1, math.ceil(share * self.batch - 1e-9))

    def waiting(self) -> int:
        return sum(len(groups) for groups in self.pool.values())

    def take(self, version: int) -> list[Accepted] | None:
        """The next update's ``batch`` groups (freshest first, capped per signer), or None while there are too few."""
        self.drop_stale(version)
        if self.barrier:
            return self._take_barrier(version)
        cap = self.cap(version)
        most = cap + math.ceil(cap * BURST - 1e-9)

        def allow(owner: bytes) -> int:  # within [cap, most], also when the cap moved (contributors came or went)
            return min(most, max(cap, self.tokens.get(owner, most)))

        allowed = {owner: allow(owner) for owner in self.pool}
        if sum(min(allowed[owner], len(groups)) for owner, groups in self.pool.items()) < self.batch:
            # enough groups but too many of one signer's: the update waits for the others' shares
            self.counts["short_capped" if self.waiting() >= self.batch else "short"] += 1
            return None
        candidates = sorted(
            ((a, i) for groups in self.pool.values() for i, a in enumerate(groups)),
            key=lambda ai: (-ai[0].group.version, ai[0].group.created, ai[1]),
        )
        chosen = self._choose(candidates, allowed)
        self._renew_probation()
        given = Counter(a.owner for a in chosen)
        for owner in set(self.tokens) | set(given):  # every signer earns ``cap`` per update, up to ``most``
            left = min(most, allow(owner) - given[owner] + cap)
            if left >= most:
                self.tokens.pop(owner, None)  # full: the default, so the table holds only signers in debt
            else:
                self.tokens[owner] = left
        return chosen

    def _take_barrier(self, version: int) -> list[Accepted] | None:
        peers = self.contributing(version)
        if not peers:
            return None
        share = math.ceil(self.batch / len(peers))
        fresh = {o: [a for a in self.pool.get(o, []) if a.group.version == version] for o in peers}
        if any(len(groups) < share for groups in fresh.values()):
            return None
        candidates = [(a, i) for o in peers for i, a in enumerate(fresh[o][:share])]
        return self._choose(candidates, dict.fromkeys(peers, share))

    def _choose(self, candidates: list[tuple[Accepted, int]], allowed: dict[bytes, int]) -> list[Accepted]:
        """The first ``batch`` of ``candidates`` with at most ``allowed[signer]`` per signer; marked used, out of the
        pool."""
        chosen: list[Accepted] = []
        per_owner: Counter = Counter()
        for accepted, _ in candidates:
            if per_owner[accepted.owner] < allowed[accepted.owner]:
                chosen.append(accepted)
                per_owner[accepted.owner] += 1
                if len(chosen) == self.batch:
                    break
        for a in chosen:
            self.used[a.owner][a.group.seq] = a.group.version
            self.prove(a.owner)
        taken = {id(a) for a in chosen}
        for owner in list(self.pool):
            self.pool[owner] = [a for a in self.pool[owner] if id(a) not in taken]
        return chosen

    # --- state for checkpoints -------------------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "banned": {owner.hex(): reason for owner, reason in self.banned.items()},
            # only what updates took: groups read but not yet used are read again (and used) after a restart
            "used": {owner.hex(): [[s, v] for s, v in sorted(seqs.items())] for owner, seqs in self.used.items()},
        }

    def restore(self, state: dict) -> None:
        for owner, reason in state.get("banned", {}).items():
            self.ban(bytes.fromhex(owner), reason)
        for owner, pairs in state.get("used", {}).items():
            used = {int(s): int(v) for s, v in pairs}
            self.used[bytes.fromhex(owner)].update(used)
            self.seqs[bytes.fromhex(owner)].update(used)
            self.prove(bytes.fromhex(owner), len(used))  # groups updates took: out of probation again

    # --- internals -------------------------------------------------------------------------------------------------

    def _credit(self, owner: bytes, what: str, n: int = 1) -> None:
        if self.credit is not None and n > 0:
            self.credit.count(key_fingerprint(owner), what, n)

    def _refuse(self, owner: bytes, refused: Refused) -> Refused:
        self.rejected[refused.reason] += 1
        self.rejected_by.add(owner)
        self._credit(owner, refused.reason)
        if refused.reason not in FORGIVEN:
            self.ban(owner, str(refused))
        elif refused.reason in STRIKES:
            limit = STRIKE_UPDATES * self.batch * (self.spec.staleness.tau_max + 1)
            if self.strikes.add(owner) > limit:
                what = "unreadable groups" if refused.reason == "schema" else "groups of versions not in this lineage"
                self.ban(owner, f"{self.strikes[owner]} {what} in a row ({refused})")
        return refused

    def _unavailable(self, owner: bytes, refused: Refused) -> Refused:
        """Refuse a group whose blob could not be fetched, and mute its signer (unless muted already: the entry's
        other groups, or fetches that were in flight when the mute began)."""
        now = self.clock()
        ends, lasted = self.muted.get(owner, (0.0, 0.0))
        if ends <= now:
            lasted = min(MUTE_MOST, 2 * lasted) if lasted else MUTE_FIRST
            self.muted[owner] = (now + lasted, lasted)
            self.muted.move_to_end(owner)
            while len(self.muted) > MAX_SIGNER_STATE:
                self.muted.popitem(last=False)
            self.counts["muted"] += 1
        return self._refuse(owner, refused)

    def is_muted(self, owner: bytes) -> bool:
        return owner in self.muted and self.muted[owner][0] > self.clock()

    def _admit(self, accepted: Accepted) -> None:
        owner = accepted.owner
        self.last_verified[owner] = max(accepted.group.version, self.last_verified.get(owner, -1))
        self.last_arrival[owner] = self.clock()
        groups = self.pool[owner]
        groups.append(accepted)
        bound = self.batch * (self.spec.staleness.tau_max + 1)
        if len(groups) > bound:
            groups.sort(key=lambda a: (a.group.version, a.group.seq))
            self.rejected["surplus"] += len(groups) - bound
            self.rejected_by.add(accepted.owner, len(groups) - bound)
            self._credit(accepted.owner, "surplus", len(groups) - bound)
            del groups[: len(groups) - bound]
        self.counts["admitted"] += 1


class Skipped:
    """The signers whose entries a learner's reader skips now: the intake's banned (for good) and muted ones (until
    their mute ends). A container over the intake's live state, safe to test from the reader's thread."""

    def __init__(self, intake: Intake):
        self.intake = intake

    def __contains__(self, owner: object) -> bool:
        return owner in self.intake.banned or self.intake.is_muted(owner)


class Newcomers:
    """The signers on probation (fewer than ``PROBATION`` groups checked or used): their group blobs share half a
    learner's fetch workers, however many keys they are (a live view, safe to test from the reader's thread)."""

    def __init__(self, intake: Intake):
        self.intake = intake

    def __contains__(self, owner: object) -> bool:
        return isinstance(owner, bytes) and self.intake.on_probation(owner)


__all__ = ["FORGIVEN", "Accepted", "Intake", "Newcomers", "Skipped"]
