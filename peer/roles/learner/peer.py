"""The learner peer (``hivegrpo learn``): turn verified bucket groups into adapter versions.

Start-up is a rollout peer's (:mod:`peer.run.session`): join, manifest, base model, newest adapter — then the
checkpoint in ``--checkpoint-dir`` wins if it is newer than anything announced. Then, over and over:

1. a fetcher thread reads the buckets of versions ``v - tau_max .. v`` (entries not read before);
2. the intake (:mod:`peer.roles.learner.intake`) verifies every group — prompt re-derived from the signer's seed, every
   reward recomputed, replays and liars banned — and a private random sample has its behaviour log-probs
   recomputed here, under the adapter version it claims;
3. once ``groups_per_version`` groups (the manifest's) are waiting, the freshest are taken, capped per signer;
   each is weighted by ``w(tau)``, and one clipped-loss AdamW step over all of them makes version ``v + 1``;
4. the new adapter's bytes go into this peer's blob cache and an announcer thread announces
   ``(v + 1, sha256, parent sha256, size, providers)``, with this learner's metrics; rollout peers follow it.

Every accepted group is in exactly one update (``--ledger`` writes, per version, which ones). Checkpoints (adapter,
optimizer state, version, bans, the seqs updates used) are written every ``checkpoint_every`` versions, atomically.

Several learners on one run make one lineage (:mod:`peer.roles.learner.team.member`): the one that leads does all of
the above, computing each update's gradient in shares with the others; they apply every step it makes and go on from
it if it dies (docs/learner.md, "Several learners").

Every learner also keeps the contributors' credit over the whole run (:mod:`peer.run.credit`): in its checkpoints
and journal, merged from the admitted learners' records at start and on a takeover, published every few seconds.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from peer.closers import Closers
from peer.errors import UserError
from peer.log import get_logger
from peer.model.adapter import adapter_to_bytes, lora_parameters, sha256_hex
from peer.model.peft_folder import base_model_name
from peer.network.heartbeat import Reachable
from peer.network.swarm import NetworkConfig
from peer.protocol import (
    Demand,
    MetricsRecord,
    PeerTally,
    key_fingerprint,
)
from peer.protocol.limits import MAX_HISTORY, MAX_TALLIED
from peer.roles.learner.checker import Checker, CheckerGone
from peer.roles.learner.checkpoint import (
    append_journal,
    journal_chain,
    plan_resume,
    read_checkpoint,
    restore_credit,
    write_checkpoint,
)
from peer.roles.learner.intake import Accepted, Intake
from peer.roles.learner.io import Announcer, Fetcher
from peer.roles.learner.record import VersionRecord
from peer.roles.learner.state import LearnerState
from peer.roles.learner.team.member import Teamwork
from peer.roles.learner.update import (
    MicroBatcher,
    Share,
    apply_gradient,
    batch_tensors,
    enable_gradient_checkpointing,
    learn_step,
)
from peer.roles.learner.verify import LogprobCheck, Refused, check_logprobs_many
from peer.roles.supervisor import supervise
from peer.run.adapters import REDEMAND_EVERY
from peer.run.credit import CreditPublisher, CreditTable, merge_admitted
from peer.run.session import Session, SessionConfig, default_cache_dir, open_session

logger = get_logger(__name__)

SPOT_CHECK_BATCH = 16  # log-prob checks wait until this many are due (or the update needs them, or SPOT_CHECK_WAIT)
SPOT_CHECK_WAIT = 1.0  # s the first group drawn for a check waits at most for others to share its forward passes
CHECK_POLL = 0.02  # s between two looks for verdicts while an update waits on groups a check holds
CHECKS_IN_FLIGHT = 64  # groups at most with the checking process; beyond, the loop checks (it falls behind: bounded)
DEMAND_WINDOW = 10.0  # s over which the consumption rate in the announcements is measured


@dataclass(frozen=True)
class LearnerConfig:
    run_id: str
    network: NetworkConfig = field(default_factory=NetworkConfig)
    coordinator: str | None = None
    quantization: str | None = None
    device: str = "auto"
    dtype: str = "auto"  # compute dtype: auto, float32, bfloat16 or float16
    cache_dir: Path = field(default_factory=default_cache_dir)
    heartbeat_interval: float = 10.0
    allowed_tasks: tuple[str, ...] = ()  # plug-in task modules the manifest may name (--allow-task)
    learner_credential: str | None = None  # the host's credential admitting this learner (hgl1.…)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10  # versions
    max_versions: int | None = None  # stop after making this many versions
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    share_cap: float = 0.5  # most of one update a single signer may give (when others contribute)
    check_rate: float = 0.1  # fraction of groups whose behaviour log-probs are recomputed
    check_process: bool = True  # on CPU, spot checks run in a child process beside the updates (checker.py)
    logprob_tolerance: float = 0.05  # median |Δ| nats over a group's tokens; LogprobCheck.with_tolerance
    poll_interval: float = 0.25
    ledger: Path | None = None  # JSON lines: per version, the groups in its update and the metrics
    micro_batch_tokens: int | None = None  # tokens per forward/backward (the same update); None: the whole batch
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    name: str | None = None  # this peer's --name in its heartbeat (status shows it)
    max_upload: float | None = None  # bytes/s its blob server sends at most (--max-upload); None: no limit
    metrics_port: int | None = None  # serve Prometheus metrics at http://metrics_host:PORT/metrics (0: any free port)
    metrics_host: str = "127.0.0.1"  # the address the metrics are served on

    def __post_init__(self):
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.max_versions is not None and self.max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {self.max_versions}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not self.logprob_tolerance > 0:
            raise ValueError(f"logprob_tolerance must be positive, got {self.logprob_tolerance}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"micro_batch_tokens must be >= 1 (or None: the whole batch), got {self.micro_batch_tokens}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0: any free port), got {self.metrics_port}")

    def session_config(self) -> SessionConfig:
        return SessionConfig.of(self)


@dataclass(frozen=True)
class LearnerSummary:
    """What :meth:`LearnerPeer.run` did (``hivegrpo learn`` prints it; ``--json`` prints :meth:`to_json`)."""

    versions_made: int  # made, or (helping) applied
    adapter_version: int
    adapter_sha256: str
    groups_accepted: int  # used in this learner's updates
    groups_dropped_stale: int
    groups_stale_on_arrival: int  # of those, the ones already too old when read (the rest aged in the pool)
    groups_no_signal: int
    arrival_lag: dict[int, int]  # groups read by how many versions behind this learner's they were (tau_max + 1: more)
    takes_short: dict[str, int]  # takes short of groups, and of other signers' groups (the share cap)
    groups_rejected: dict[str, int]  # by reason
    ignored_banned: int
    mutes: int  # signers muted a while since a blob of theirs could not be fetched (counted each time)
    banned: list[str]  # key fingerprints
    logprob_checks: int
    seconds: float
    groups_per_second: float
    step_seconds_mean: float
    staleness_mean: float
    staleness_max: int
    announce_failures: int
    credit: dict[str, int]  # contributors, groups used, records published
    resumed_from: str  # "swarm", or the checkpoint / journal it resumed from
    peer_id: str
    team: dict  # leading or helping, and what the team protocol counted
    busy_fraction: float  # training CPU seconds per wall second
    phase_seconds: dict[str, float]  # wall seconds of the leading loop by phase

    def to_json(self) -> dict:
        return asdict(self)


class LearnerPeer:
    """One learner: :meth:`start`, :meth:`run` (the loop), :meth:`close`. It leads its team of learners (alone: a
    team of one) or helps the learner that does (:mod:`peer.roles.learner.team.lead`)."""

    def __init__(self, config: LearnerConfig, barrier: bool = False):
        """``barrier``: the synchronous baseline a benchmark measures against (:class:`Intake`'s), never a run's."""
        self.config = config
        self.barrier = barrier
        self.stop_event = threading.Event()
        self._closers = Closers()
        self.session: Session | None = None
        self.intake: Intake | None = None
        self.state: LearnerState | None = None  # the lineage state: model, AdamW, parent, window (start makes it)
        self.made = 0  # versions made (or, helping, applied) by this run of the learner
        self.step_seconds: list[float] = []
        self.phases: Counter = Counter()  # wall seconds of the leading loop by phase (read, check, take, update, wait)
        self.train_cpu = 0.0  # CPU seconds this thread spent computing updates (gradient and AdamW step)
        self.busy = 0.0  # training CPU seconds / wall seconds, over the recent versions (status shows it)
        self.used = 0  # groups this learner's updates used
        self._announced_at = 0.0  # monotonic time of this learner's latest announcement (for re-announcements)
        self._consumption: deque[tuple[float, int, float]] = deque()  # (time, groups consumed, s waited)
        self._since_version = time.perf_counter()  # when the previous version was made (busy fraction per version)
        self.staleness: list[int] = []
        self.history: list[VersionRecord] = []
        self.accepted_by: Counter = Counter()  # signer -> groups used in an update
        self.resumed_from: str = "swarm"
        self._checkpoint_after_start = False
        self.fetcher: Fetcher | None = None  # reads the buckets while this learner leads
        self.checker: Checker | None = None  # spot checks beside the updates (CPU), else on the loop
        self.team = Teamwork(self)
        self.micro = MicroBatcher(config.micro_batch_tokens)  # halves (and keeps) its tokens when memory runs out
        self.credit = CreditTable()  # per contributor over the run (peer.run.credit); in checkpoints and journal
        self.credit_publisher: CreditPublisher | None = None

    # --- start-up --------------------------------------------------------------------------------------------------

    def start(self) -> LearnerPeer:
        from peer.network.buckets import FETCH_WORKERS, NETWORK_EVERY, DHTBucketStore

        c = self.config
        if c.metrics_port is not None:  # first: a port in use fails before anything is loaded
            from peer.metrics import LearnerCollector, serve_metrics

            self._closers.add(serve_metrics(LearnerCollector(self), c.metrics_host, c.metrics_port).close)
        self.session = s = open_session(c.session_config(), "learner", self._closers)
        self.session.on_revoked.append(self.request_stop)
        spec = s.spec
        self.intake = Intake(
            spec,
            s.tokenizer,
            batch=spec.groups_per_version,
            share_cap=c.share_cap,
            check_rate=c.check_rate,
            barrier=self.barrier,
        )
        self.state = LearnerState(s, torch.optim.AdamW(lora_parameters(s.model), lr=c.lr), self.intake)
        if c.gradient_checkpointing:
            enable_gradient_checkpointing(s.model)
        self.intake.credit = self.credit
        self._resume()
        self.merge_credit()  # before the intake counts anything: merging by maximum needs one history on each side
        self.state.bans_recorded = self.intake.bans_made
        self.state.remember()
        if self._checkpoint_after_start:
            self.checkpoint()
        s.model.eval()
        if c.check_rate > 0 and c.check_process and s.device.type == "cpu":  # no fork once CUDA is initialised
            self.checker = Checker(s.model, spec, LogprobCheck.with_tolerance(c.logprob_tolerance))
            self._closers.add(self.checker.close)
            logger.info("spot checks run in process %d, beside the updates", self.checker.pid)
        self.store = DHTBucketStore(s.swarm, s.blobs, network_every=NETWORK_EVERY, fetch_workers=FETCH_WORKERS)
        self._closers.add(self.store.close)
        self._closers.add(self.stop_fetcher)
        learners = Reachable(s.swarm, "learner", admitted=s.admitted)  # served new versions at once (not seeded)
        followers = Reachable(s.swarm, ("rollout", "observer"))  # each announcement is pushed to their DHT nodes
        self.announcer = Announcer(
            s.swarm, s.blobs, lineage=lambda: self.intake.known, exempt=learners, followers=followers
        )
        self._closers.add(self.announcer.close)
        self.credit_publisher = CreditPublisher(s.swarm, self.credit, lambda: self.session.version).start()
        self._closers.add(self.credit_publisher.close)
        if s.version > 0:  # what it resumed from is served and announced by this learner too
            self.announcer.submit(s.version, s.blob, self.state.parent, None)
        self.team.start(self._closers)
        s.heartbeat.update(state="running")  # status and the host's page show it running, not starting
        logger.info(
            "learner ready: adapter v%d (%s), %d groups per version, tau_max %d, weighting %s",
            s.version,
            self.resumed_from,
            spec.groups_per_version,
            spec.staleness.tau_max,
            spec.staleness.weighting,
        )
        return self

    def _resume(self) -> None:
        """Take this learner's own state when it is at least as new as the swarm's newest version: the checkpoint,
        then the journal's versions after it whose adapters are still in the blob cache (a learner killed between
        checkpoints loses none of the versions it made). The same version as announced must be the same bytes."""
        s, c = self.session, self.config
        if not c.checkpoint_dir:
            return
        checkpoint = read_checkpoint(c.checkpoint_dir)
        meta, blob, optimizer_state = checkpoint if checkpoint is not None else (None, None, None)
        if meta is not None and meta["run_id"] != c.run_id:
            raise UserError(
                f"{c.checkpoint_dir} holds a checkpoint of run {meta['run_id']!r}, not {c.run_id!r}: pass another "
                "--checkpoint-dir"
            )
        restore_credit(self.credit, meta or {}, c.checkpoint_dir)  # the run's credit, whichever lineage continues
        start = (meta["version"], meta["sha256"]) if meta is not None else (0, s.spec.manifest.adapter0_sha256)
        plan = plan_resume(
            meta,
            journal_chain(c.checkpoint_dir, *start),
            s.blobs.cache.has,
            (s.version, s.sha),
        )
        if plan.rewrite:
            logger.warning(
                "this learner's own state (v%d) is older than the announced v%d: continuing from the swarm's (fresh "
                "optimizer state)",
                plan.version,
                s.version,
            )
            self._checkpoint_after_start = True  # the directory then describes the lineage this learner is in
        if not plan.own:
            return
        if plan.chain:
            blob = s.blobs.cache.path(plan.sha).read_bytes()
        if plan.version > s.version:
            s.swap(plan.version, plan.sha, blob)
        if optimizer_state is not None:
            self.state.optimizer.load_state_dict(optimizer_state)  # the checkpoint's: len(chain) updates older
        if meta is not None:
            self.intake.restore(meta)
        for line in plan.chain:
            self.intake.restore(line["intake"])
        self.state.parent = plan.parent
        self.resumed_from = plan.describe(c.checkpoint_dir)
        if plan.chain:
            logger.info(
                "resumed v%d: v%d and the journal's next %d version(s) (AdamW state %s)",
                plan.version,
                start[0],
                len(plan.chain),
                "of the checkpoint" if optimizer_state is not None else "fresh",
            )

    # --- the team --------------------------------------------------------------------------------------------------

    def start_fetcher(self) -> None:
        s = self.session
        self.fetcher = Fetcher(
            self.store, s.spec.staleness.tau_max, self.config.poll_interval, self.intake.skipped, self.intake.newcomers
        )
        self.fetcher.version = s.version
        self.fetcher.start()

    def stop_fetcher(self) -> None:
        if self.fetcher is not None:
            self.fetcher.stop()
            self.fetcher = None

    def beat(self) -> None:
        self.session.heartbeat.update(
            adapter_version=self.session.version,
            throughput=self._rate(),
            stats={
                "versions": float(self.made),
                "accepted": float(sum(h.groups for h in self.history)),
                "rejected": float(sum(self.intake.rejected.values())),
                "banned": float(len(self.intake.banned)),
                "waiting": float(self.intake.waiting()),
                "no_signal": float(self.intake.counts["no_signal"]),
                "no_signal_share": round(self.intake.no_signal_share(), 3),
                "busy": round(self.busy, 3),
                **self.team.heartbeat_stats(),
            },
        )

    # --- the loop --------------------------------------------------------------------------------------------------

    def merge_credit(self) -> None:
        """Merge the admitted learners' credit records into this learner's (by maximum: no count goes down): at
        start, and when it takes its team over (peer.run.credit)."""
        s = self.session
        try:
            merge_admitted(self.credit, s.swarm, s.admitted)
        except Exception as e:  # the network boundary: this learner's own counts stand; the next takeover merges
            logger.warning("could not read the learners' credit records: %s", e)

    def request_stop(self) -> None:
        self.stop_event.set()

    def run(self, max_seconds: float | None = None) -> LearnerSummary:
        """Learn until stopped, ``max_versions`` or ``max_seconds``; returns what was done."""
        s, c, intake = self.session, self.config, self.intake
        started = time.perf_counter()
        while not self.stop_event.is_set():
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                break
            if c.max_versions is not None and self.made >= c.max_versions:
                break
            if self.team.leader is not None:
                self.team.help_once()
                continue
            with self._phase("team"):
                self.team.leader_turn()
            if self.team.leader is not None:  # it found a better leader
                continue
            with self._phase("read"):
                self._read(timeout=0.0)
            with self._phase("check"):
                self._spot_check(minimum=self._checks_due())
            with self._phase("take"):
                chosen = intake.take(s.version)
            if chosen is None:
                with self._phase("check"):
                    self._spot_check()  # the groups waiting for a check may be the ones missing
                with self._phase("take"):
                    chosen = intake.take(s.version)
            if chosen is None:
                with self._phase("wait"):
                    self.fetcher.wake()  # too few groups: read the buckets now, and wait for what comes
                    if self.checker is not None and self.checker.in_flight:  # or for the verdicts on some
                        self._collect_checks(timeout=CHECK_POLL)
                        self._read(timeout=0.0)
                    else:
                        self._read(timeout=c.poll_interval)
                    self._redemand()
                continue
            with self._phase("update"):
                self._update(chosen)
        self.announcer.flush()
        seconds = time.perf_counter() - started
        if c.checkpoint_dir and self.made and self.state.checkpointed != frozenset({s.sha}):
            self.checkpoint()
        accepted = sum(h.groups for h in self.history)
        return LearnerSummary(
            versions_made=self.made,
            adapter_version=s.version,
            adapter_sha256=s.sha,
            groups_accepted=accepted,
            groups_dropped_stale=intake.counts["dropped_stale"],
            groups_stale_on_arrival=intake.counts["stale_on_arrival"],
            groups_no_signal=intake.counts["no_signal"],
            arrival_lag=dict(sorted(intake.arrival_lag.items())),
            takes_short={"of_groups": intake.counts["short"], "of_other_signers": intake.counts["short_capped"]},
            groups_rejected=dict(intake.rejected),
            ignored_banned=intake.counts["ignored_banned"],
            mutes=intake.counts["muted"],
            banned=sorted(key_fingerprint(o) for o in intake.banned),
            logprob_checks=intake.counts["checked"],
            seconds=round(seconds, 3),
            groups_per_second=round(accepted / seconds, 3) if seconds else 0.0,
            step_seconds_mean=round(sum(self.step_seconds) / len(self.step_seconds), 4) if self.step_seconds else 0,
            staleness_mean=round(sum(self.staleness) / len(self.staleness), 3) if self.staleness else 0.0,
            staleness_max=max(self.staleness, default=0),
            announce_failures=self.announcer.failures,
            credit={
                "contributors": len(self.credit),
                "groups_used": self.credit.groups_used,
                "published": self.credit_publisher.published if self.credit_publisher else 0,
            },
            resumed_from=self.resumed_from,
            peer_id=str(s.swarm.peer_id),
            team=self.team.summary(),
            busy_fraction=round(self.train_cpu / seconds, 3) if seconds else 0.0,
            phase_seconds={k: round(v, 2) for k, v in self.phases.most_common()},
        )

    @contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - t0

    def _read(self, timeout: float) -> None:
        """Move what the fetcher read into the intake (waiting up to ``timeout`` for the first entry)."""
        try:
            fetched = [self.fetcher.queue.get(timeout=timeout) if timeout > 0 else self.fetcher.queue.get_nowait()]
        except queue.Empty:
            return
        while True:
            try:
                fetched.append(self.fetcher.queue.get_nowait())
            except queue.Empty:
                break
        for f in fetched:
            was_banned = f.owner in self.intake.banned
            refused = self.intake.add(f, self.session.version)
            if isinstance(refused, Refused):
                who = key_fingerprint(f.owner)
                logger.warning("refused group %d.%d from %s: %s", f.version, f.seq, who, refused)
                if not was_banned and f.owner in self.intake.banned:
                    logger.warning("banned %s for this run", who)

    def _checks_due(self) -> int:
        """How many groups must wait for a check before they are checked now. With the checking process, any one:
        its forward passes cost the loop nothing, and a group waiting for its turn is one the next update may
        miss. On the loop, ``SPOT_CHECK_BATCH`` (one forward pass per version then serves several groups), or any
        one once the first has waited ``SPOT_CHECK_WAIT`` s (a forger's groups are found within about a second)."""
        if self.checker is not None:
            return 1
        intake = self.intake
        waited = intake.clock() - intake.pending_since
        return 1 if intake.checks_waiting() and waited >= SPOT_CHECK_WAIT else SPOT_CHECK_BATCH

    def _spot_check(self, minimum: int = 1) -> None:
        """Recompute the behaviour log-probs of the sampled groups, each under the adapter version it claims, once
        at least ``minimum`` wait (checks are batched: one forward pass per version).

        An older version is visited by copying its LoRA tensors into the model and back (about a millisecond on the
        bundled model; loading and re-hashing the blob took 25 ms a visit): the bytes are this learner's own.
        """
        self._collect_checks()
        if self.intake.checks_waiting() < minimum:
            return
        pending = self.intake.pending_checks()
        if not pending:
            return
        if self.checker is not None and self.checker.groups_in_flight < CHECKS_IN_FLIGHT:
            pending = self._hand_checks_over(pending)
            if not pending:
                return
        s = self.session
        params = lora_parameters(s.model)
        try:
            for version in sorted({a.group.version for a in pending}):
                known = self.state.window.get(version)
                if known is None:  # too old to check any more: it will be dropped as stale
                    for a in pending:
                        if a.group.version == version:
                            self.intake.checked(a, None)
                    continue
                _copy_into(params, known[1])
                these = [a for a in pending if a.group.version == version]
                check = LogprobCheck.with_tolerance(self.config.logprob_tolerance)
                verdicts = check_logprobs_many(s.model, [a.group for a in these], s.spec, check=check)
                for a, refused in zip(these, verdicts, strict=True):
                    self._checked(a, refused)
        finally:
            _copy_into(params, self.state.window[s.version][1])

    def _hand_checks_over(self, pending: list[Accepted]) -> list[Accepted]:
        """Submit ``pending`` to the checking process, one submission per version; returns what is left to check
        here (everything, once that process is gone)."""
        window = self.state.window
        versions = sorted({a.group.version for a in pending})
        for i, version in enumerate(versions):
            these = [a for a in pending if a.group.version == version]
            known = window.get(version)
            if known is None:  # too old to check any more: it will be dropped as stale
                for a in these:
                    self.intake.checked(a, None)
                continue
            try:
                self.checker.submit((version, known[0]), known[1], [a.group for a in these], min(window), these)
            except CheckerGone as e:
                self._checker_gone(e)
                return [a for a in pending if a.group.version in versions[i:]]
        return []

    def _collect_checks(self, timeout: float = 0.0) -> None:
        """Apply the verdicts the checking process sent since (waiting up to ``timeout`` s for the first)."""
        if self.checker is None or not self.checker.in_flight:
            return
        try:
            answered = self.checker.results(timeout)
        except CheckerGone as e:
            self._checker_gone(e)
            return
        for these, verdicts in answered:
            for a, refused in zip(these, verdicts, strict=True):
                if self.intake.known.get(a.group.version) != a.group.adapter_sha256:
                    continue  # handed over before this learner took another lineage (a leader's state)
                self._checked(a, refused)

    def _groups_in_checks(self) -> int:
        """Groups handed to the checking process and not judged yet (they count as waiting in the demand)."""
        return 0 if self.checker is None else self.checker.groups_in_flight

    def _checked(self, accepted: Accepted, refused: Refused | None) -> None:
        if refused is not None and accepted.owner not in self.intake.banned:
            logger.warning("banned %s for this run: %s", key_fingerprint(accepted.owner), refused)
        self.intake.checked(accepted, refused)

    def _checker_gone(self, error: CheckerGone) -> None:
        """Check on the loop from now on; what the checking process held goes back to the intake's queue."""
        checker, self.checker = self.checker, None
        back = [a for these in checker.unanswered() for a in these]
        self.intake.recheck(back)
        logger.warning("%s; checking log-probs between updates from now on (%d group(s) again)", error, len(back))
        checker.close(timeout=1.0)

    def _update(self, chosen: list[Accepted]) -> None:
        """Make version ``v + 1`` from ``chosen`` (its gradient computed in shares with the helpers, if any)."""
        s, c = self.session, self.config
        t0, cpu0 = time.perf_counter(), time.thread_time()
        combined, cost = self.team.gradient(chosen)
        taus = [s.version - a.group.version for a in chosen]
        self.staleness.extend(taus)
        self.used += len(chosen)
        if combined is None:  # every group's rewards were all equal: they are used, but nothing moves
            self._record(None, chosen, taus, time.perf_counter() - t0, None)
            return
        grad_norm = apply_gradient(s.model, self.state.optimizer, combined.grads, c.max_grad_norm)
        train_cpu = time.thread_time() - cpu0
        self.train_cpu += train_cpu
        now = time.perf_counter()
        busy = train_cpu / max(1e-6, now - self._since_version)  # of the wall time since the previous version
        self._since_version = now
        self.busy = busy if not self.step_seconds else 0.9 * self.busy + 0.1 * busy
        blob = adapter_to_bytes(s.model)
        parent, sha = s.sha, sha256_hex(blob)
        seconds = time.perf_counter() - t0
        self.step_seconds.append(seconds)
        stats = {**combined.stats, "grad_norm": grad_norm, "busy": round(busy, 3), **cost}
        record = self._record(parent, chosen, taus, seconds, stats, version=s.version + 1, sha=sha)
        delta = self.state.intake_delta(chosen)
        self.team.stepped(chosen, combined.grads, blob, parent, record, delta)
        self.advance(parent, sha, blob, record, self._metrics(record), delta)

    def share(self, part: list[Accepted]) -> Share | None:
        s = self.session
        if not part:
            return None
        share = self.micro.share_gradient(
            s.model, batch_tensors(part, s.version, s.spec, self.pad_id(), s.device), s.spec
        )
        if share is not None:  # groups written, not sampled: their signers banned
            for a, refused in self.intake.refuse_written(part, share.evidence):
                logger.warning("banned %s for this run: %s", key_fingerprint(a.owner), refused)
        return share

    def advance(
        self,
        parent: str,
        sha: str,
        blob: bytes,
        record: VersionRecord,
        metrics: MetricsRecord | None,
        intake_delta: dict,
        ledger_line: dict | None = None,
    ) -> None:
        """The model now holds the next version (made here or applied from the leader): journal, keep, announce,
        log it. Applied, ``record`` is the leader's, and ``ledger_line`` its line as the leader wrote it."""
        s, c = self.session, self.config
        self.credit.count_used(intake_delta["used"])  # before the journal line: it carries the credit that changed
        if c.checkpoint_dir:  # before anyone can see the version (a helper's next request says it holds it): a
            s.blobs.cache.put_bytes(blob, sha256=sha)  # restart after a crash resumes from the journal and this blob
            append_journal(c.checkpoint_dir, s.version + 1, sha, parent, intake_delta, self.credit.take_delta())
        self.state.advance(parent, sha, blob)
        self.made += 1
        if self.fetcher is not None:
            self.fetcher.version = s.version
        if self.team.leader is not None:  # applied: the leader's record, kept here too
            self.history.append(record)
            self._ledger(ledger_line if ledger_line is not None else record.to_json())
        gate = None
        if self.team.leader is None:  # leading: announced once the helpers hold it (none: at once)
            gate = lambda v=s.version: self.team.lead.holds(v)  # noqa: E731
        self.announcer.submit(s.version, blob, parent, metrics, gate, self.demand() if gate is not None else None)
        self._announced_at = time.monotonic()
        self.beat()
        if c.checkpoint_dir and self.made % c.checkpoint_every == 0:
            self.checkpoint()

    def adopt(self, state: dict) -> None:
        """Take a leader's whole state (:meth:`LearnerState.adopt`; it raises, changing nothing, when the state does
        not fit): then serve and announce it, and checkpoint it (the journal cannot chain a state taken whole)."""
        self.state.adopt(state)
        self.announcer.submit(self.session.version, self.session.blob, self.state.parent, None)
        if self.config.checkpoint_dir:
            self.checkpoint()
        self.beat()

    def _redemand(self) -> None:
        """Waiting for groups without making a version: every ``REDEMAND_EVERY`` s announce the held version again
        with a fresh demand, so rollout peers know this learner is alive and still wants groups."""
        now = time.monotonic()
        if now - self._announced_at < REDEMAND_EVERY or self.team.leader is not None:
            return
        demand = self.demand()
        if demand is not None and self.session.version > 0:
            self._announced_at = now
            self.announcer.submit(self.session.version, self.session.blob, self.state.parent, None, None, demand)

    def demand(self) -> Demand | None:
        """What this learner would consume if it never waited, for its announcement (rollout peers pace to it):
        groups used or counted as without signal over the last ``DEMAND_WINDOW`` seconds, per second of them it
        spent not waiting for groups (consumption alone would fall with a starved learner, and the rollout peers
        with it); None until the window spans a second."""
        now, consumed, waited = time.monotonic(), self.used + self.intake.counts["no_signal"], self.phases["wait"]
        window = self._consumption
        window.append((now, consumed, waited))
        while len(window) > 2 and window[1][0] <= now - DEMAND_WINDOW:
            window.popleft()
        then, before, waited_before = window[0]
        if now - then < 1.0:
            return None
        working = max(0.1 * (now - then), (now - then) - (waited - waited_before))
        return Demand(
            groups_per_second=round(min(1e6, (consumed - before) / working), 3),
            waiting=self.intake.waiting() + self.intake.checks_waiting() + self._groups_in_checks(),
            contributors=self.intake.contributors(self.session.version),
        )

    def _record(self, parent, chosen, taus, seconds, stats, version=None, sha=None) -> VersionRecord:
        s = self.session
        rewards = [r for a in chosen for r in a.group.rewards]
        record = VersionRecord(
            version=s.version if version is None else version,
            sha256=s.sha if sha is None else sha,
            parent_sha256=parent,
            time=time.time(),
            groups=len(chosen),
            staleness_mean=sum(taus) / len(taus),
            staleness_max=max(taus),
            reward_mean=sum(rewards) / len(rewards),
            step_seconds=round(seconds, 4),
            waiting=self.intake.waiting(),
            dropped_stale=self.intake.counts["dropped_stale"],
            dropped_no_signal=self.intake.counts["no_signal"],
            no_signal_share=round(self.intake.no_signal_share(), 3),
            rejected=dict(self.intake.rejected),
            banned=sorted(key_fingerprint(o) for o in self.intake.banned),
            per_peer=dict(Counter(key_fingerprint(a.owner) for a in chosen)),
            stats=stats,
        )
        self.history.append(record)
        self.accepted_by.update(a.owner for a in chosen)
        if stats is not None:
            logger.info(
                "v%d: %d groups (tau mean %.2f max %d), reward %.3f, clip %.3f, ratio %.3f, step %.3fs%s",
                record.version,
                len(chosen),
                record.staleness_mean,
                record.staleness_max,
                record.reward_mean,
                stats["clip_fraction"],
                stats["ratio_mean"],
                seconds,
                f", {stats['helpers']} helpers" if stats.get("helpers") else "",
            )
        blobs = s.blobs  # what this learner's blob server sent so far (the spread benchmark reads it per version)
        served = {"served_bytes": blobs.served_bytes, "size": s.admitted.adapter_size} if blobs is not None else {}
        self._ledger(dict(record.to_json(), ids=[list(a.id) for a in chosen], **served))
        return record

    def _ledger(self, line: dict) -> None:
        if self.config.ledger is not None:
            with open(self.config.ledger, "a") as f:
                f.write(json.dumps(line) + "\n")

    def _metrics(self, record: VersionRecord) -> MetricsRecord:
        banned = list(self.intake.banned)[-64:]  # the most recent bans
        return MetricsRecord(
            learner=str(self.session.swarm.peer_id),
            version=self.session.version,
            groups_accepted=sum(self.accepted_by.values()),  # its own updates' (status sums over learners)
            groups_dropped_stale=self.intake.counts["dropped_stale"],
            groups_rejected=dict(list(self.intake.rejected.items())[:16]),
            staleness_mean=float(record.staleness_mean),
            staleness_max=int(record.staleness_max),
            reward_mean=min(1.0, max(0.0, float(record.reward_mean))),
            exact_match=None,
            step_seconds=float(record.step_seconds),
            banned=[key_fingerprint(o) for o in banned],
            per_peer=self._tallies(),
            reward_history=[min(1.0, max(0.0, float(h.reward_mean))) for h in self.history[-MAX_HISTORY:]],
            created=time.time(),
        )

    def _tallies(self) -> dict[str, PeerTally]:
        """Groups used and refused per producer (the most recently active ``MAX_TALLIED``), for status."""
        owners = list(dict.fromkeys([*self.intake.rejected_by, *self.accepted_by]))
        return {
            key_fingerprint(o): PeerTally(accepted=self.accepted_by[o], rejected=self.intake.rejected_by[o])
            for o in owners[-MAX_TALLIED:]
        }

    def _rate(self) -> float:
        recent = [h for h in self.history if h.time > time.time() - 30]
        if len(recent) < 2:
            return 0.0
        return sum(h.groups for h in recent[1:]) / max(1e-6, recent[-1].time - recent[0].time)

    def pad_id(self) -> int:
        t = self.session.tokenizer
        return t.pad_token_id if t.pad_token_id is not None else t.eos_token_id

    def checkpoint(self) -> None:
        s = self.session
        parent = self.state.parent
        meta = {
            "run_id": self.config.run_id,
            "version": s.version,
            "sha256": s.sha,
            "parent_sha256": parent or "",
            "created": time.time(),
            **self.intake.state(),
            "credit": self.credit.to_json(),
        }
        base_model = base_model_name(s.spec.manifest.model.name)
        write_checkpoint(self.config.checkpoint_dir, meta, s.blob, self.state.optimizer.state_dict(), base_model)
        self.state.checkpointed = frozenset({s.sha})
        logger.info("checkpoint v%d written to %s", s.version, self.config.checkpoint_dir)

    def close(self) -> None:
        self._closers.close()

    def __enter__(self) -> LearnerPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _copy_into(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def run_learner(config: LearnerConfig, on_ready=None, barrier: bool = False):
    """Start a learner, run it until stopped, close it (:func:`peer.roles.supervisor.supervise`)."""
    return supervise(LearnerPeer(config, barrier), on_ready)


__all__ = [
    "LearnerConfig",
    "LearnerPeer",
    "LearnerSummary",
    "batch_tensors",
    "learn_step",
    "read_checkpoint",
    "run_learner",
]
