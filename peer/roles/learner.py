"""The learner peer (``hivegrpo learn``): turn verified bucket groups into adapter versions.

Start-up is a rollout peer's (:mod:`peer.roles.session`): join, manifest, base model, newest adapter — then the
checkpoint in ``--checkpoint-dir`` wins if it is newer than anything announced. Then, over and over:

1. a fetcher thread reads the buckets of versions ``v - tau_max .. v`` (entries not read before);
2. the intake (:mod:`peer.roles.intake`) verifies every group — prompt re-derived from the signer's seed, every
   reward recomputed, replays and liars banned — and a private random sample has its behaviour log-probs
   recomputed here, under the adapter version it claims;
3. once ``groups_per_version`` groups (the manifest's) are waiting, the freshest are taken, capped per signer;
   each is weighted by ``w(tau)``, and one clipped-loss AdamW step over all of them makes version ``v + 1``;
4. the new adapter's bytes go into this peer's blob cache and an announcer thread announces
   ``(v + 1, sha256, parent sha256, size, providers)``, with this learner's metrics; rollout peers follow it.

Every accepted group is in exactly one update (``--ledger`` writes, per version, which ones). Checkpoints (adapter,
optimizer state, version, bans, the seqs updates used) are written every ``checkpoint_every`` versions, atomically.

One learner per run for now: several learners would each make their own lineage (see docs/learner.md).
"""

from __future__ import annotations

import io
import json
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peer.errors import UserError
from peer.log import get_logger
from peer.model.adapter import adapter_to_bytes, load_adapter_bytes, lora_parameters, sha256_hex
from peer.network.swarm import NetworkConfig
from peer.protocol import (
    GroupRecord,
    MetricsRecord,
    PeerTally,
    key_fingerprint,
    pack,
    unpack,
)
from peer.protocol.limits import MAX_HISTORY, MAX_TALLIED
from peer.roles import team
from peer.roles.adapters import announcements
from peer.roles.checkpoint import read_checkpoint, write_checkpoint
from peer.roles.closers import Closers
from peer.roles.intake import Accepted, Intake
from peer.roles.learner_io import Announcer, Fetcher
from peer.roles.session import Session, SessionConfig, default_cache_dir, open_session
from peer.roles.update import (
    Share,
    apply_gradient,
    batch_tensors,
    combine,
    learn_step,
    share_gradient,
    tensors_from_bytes,
    tensors_to_bytes,
)
from peer.roles.verify import Refused, check_logprobs_many

logger = get_logger(__name__)

SPOT_CHECK_BATCH = 4  # log-prob checks wait until this many are due (or the update needs them)
KEEP_ADAPTERS = 2  # versions beyond the staleness window whose blobs stay in the cache (for slow followers)
RIVAL_CHECK_EVERY = 5.0  # s between a leader's looks for another learner leading a lineage of its own
TAKEOVER_WAIT = 10.0  # s a helper waits for the next member to notice that the leader is gone
HELPER_MIN_WAIT = 1.0  # s the leader waits at least for its helpers' gradients ...
HELPER_WAIT_FACTOR = 3.0  # ... or this many times its own share's time; a late share is computed by the leader
HELPER_PROBATION = 2  # a helper's first results are all recomputed by the leader (then: check_rate of them)
GRADIENT_TOLERANCE = 1e-3  # largest difference of a helper's gradient from the leader's, relative to its size


@dataclass(frozen=True)
class LearnerConfig:
    run_id: str
    network: NetworkConfig = field(default_factory=NetworkConfig)
    coordinator: str | None = None
    quantization: str | None = None
    device: str = "auto"
    cache_dir: Path = field(default_factory=default_cache_dir)
    heartbeat_interval: float = 10.0
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10  # versions
    max_versions: int | None = None  # stop after making this many versions
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    share_cap: float = 0.5  # most of one update a single signer may give (when others contribute)
    check_rate: float = 0.1  # fraction of groups whose behaviour log-probs are recomputed
    logprob_tolerance: float = 0.05  # nats per token
    poll_interval: float = 0.25
    ledger: Path | None = None  # JSON lines: per version, the groups in its update and the metrics

    def __post_init__(self):
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.max_versions is not None and self.max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {self.max_versions}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not self.logprob_tolerance > 0:
            raise ValueError(f"logprob_tolerance must be positive, got {self.logprob_tolerance}")

    def session_config(self) -> SessionConfig:
        return SessionConfig(
            self.run_id,
            self.network,
            self.coordinator,
            self.quantization,
            self.device,
            self.cache_dir,
            self.heartbeat_interval,
        )


class LearnerPeer:
    """One learner: :meth:`start`, :meth:`run` (the loop), :meth:`close`. It leads its team of learners (alone: a
    team of one) or helps the learner that does (:mod:`peer.roles.team`)."""

    def __init__(self, config: LearnerConfig):
        self.config = config
        self._stop = threading.Event()
        self._closers = Closers()
        self.session: Session | None = None
        self.intake: Intake | None = None
        self.optimizer = None
        # per version of the window: its sha256 and a copy of its LoRA tensors (spot checks visit old versions)
        self.window: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self.made = 0  # versions made (or, helping, applied) by this run of the learner
        self.step_seconds: list[float] = []
        self.staleness: list[int] = []
        self.history: list[dict] = []
        self.accepted_by: Counter = Counter()  # signer -> groups used in an update
        self.resumed_from: str = "swarm"
        self._checkpointed: frozenset = frozenset()  # the sha256 of the adapter in the checkpoint (kept cached)
        self._parent_of_resumed = ""
        self.fetcher: Fetcher | None = None
        self.lead: team.Lead | None = None
        self.leader: str | None = None  # the learner this one helps (None: it leads)
        self.members: list[str] = []  # the team as the leader last said, leader first
        self.team_counts: Counter = Counter()
        self._bans_told = 0  # bans already passed on to helpers in a step
        self._helper_results: Counter = Counter()  # helper -> results received (its first ones are all checked)
        self._rng = random.Random()
        self._failed_calls = 0
        self._synced = False  # holds the team's AdamW state (from a state, or by having led)
        self._next_rival_check = 0.0
        self._unreachable: dict[str, float] = {}  # learner -> until when not to probe it again

    # --- start-up --------------------------------------------------------------------------------------------------

    def start(self) -> LearnerPeer:
        from peer.network.buckets import DHTBucketStore

        c = self.config
        self.session = s = open_session(c.session_config(), "learner", self._closers)
        self.session.on_revoked.append(self.request_stop)
        spec = s.spec
        self.intake = Intake(
            spec, s.tokenizer, batch=spec.groups_per_version, share_cap=c.share_cap, check_rate=c.check_rate
        )
        self.optimizer = torch.optim.AdamW(lora_parameters(s.model), lr=c.lr)
        self._resume()
        self._remember(s.version, s.sha)
        s.model.eval()
        self.store = DHTBucketStore(s.swarm, s.blobs)
        self._closers.add(self._stop_fetcher)
        self.announcer = Announcer(s.swarm, s.blobs)
        self._closers.add(self.announcer.close)
        if s.version > 0:  # what it resumed from is served and announced by this learner too
            self.announcer.submit(s.version, s.blob, self._parent_of_resumed, None)
        self.me = str(s.swarm.peer_id)
        self.lead = team.Lead(self.me, s.swarm.access)
        self.client = team.TeamClient(s.blobs, s.blobs.invite)
        team.serve(s.blobs, self.lead)
        self._closers.add(lambda: team.unserve(s.blobs, self.lead))
        leader = self._find_leader()
        if leader is None:
            self._take_lead("no other learner leads this run")
        else:
            self._follow(leader)
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
        """Take the checkpoint when it is newer than the newest announced version (same version: same weights,
        and the checkpoint adds the optimizer state)."""
        s, c = self.session, self.config
        checkpoint = read_checkpoint(c.checkpoint_dir) if c.checkpoint_dir else None
        if checkpoint is None:
            return
        meta, blob, optimizer_state = checkpoint
        if meta["run_id"] != c.run_id:
            raise UserError(
                f"{c.checkpoint_dir} holds a checkpoint of run {meta['run_id']!r}, not {c.run_id!r}: pass another "
                "--checkpoint-dir"
            )
        if meta["version"] < s.version or (meta["version"] == s.version and meta["sha256"] != s.sha):
            logger.warning(
                "checkpoint v%d is older than the announced v%d: continuing from the swarm's (fresh optimizer state)",
                meta["version"],
                s.version,
            )
            return
        if meta["version"] > s.version:
            s.swap(meta["version"], meta["sha256"], blob)
        self.optimizer.load_state_dict(optimizer_state)
        self.intake.restore(meta)
        self._parent_of_resumed = meta["parent_sha256"]
        self.resumed_from = f"checkpoint {c.checkpoint_dir}"

    # --- the team --------------------------------------------------------------------------------------------------

    def _find_leader(self) -> str | None:
        """The leader of the run's learners (the best one if several lead), or None: the learners announcing adapters
        and those with a heartbeat are asked, twice a second apart (a record may not have reached this peer yet)."""
        from peer.network.heartbeat import live_peers

        s = self.session
        for attempt in range(2):
            others = {r.learner for _, r in announcements(s.swarm) if r.version > 0}
            others |= {p.record.peer_id for p in live_peers(s.swarm, "learner")}
            others.discard(self.me)
            best: tuple[int, str] | None = None
            for peer in sorted(others):
                answer = self._probe(peer)
                if answer is None:
                    continue
                hint = answer.get("leader")
                if not answer.get("leading") and isinstance(hint, str) and hint != self.me:
                    peer, answer = hint, self._probe(hint)
                leads = answer and answer.get("leading") and isinstance(answer.get("version"), int)
                if leads and (best is None or team.wins((answer["version"], peer), best)):
                    best = (answer["version"], peer)
            if best is not None:
                if team.wins((s.version, self.me), best):
                    return None  # this learner holds a newer version (a checkpoint): it leads, the other follows it
                return best[1]
            if attempt == 0 and others:
                self._stop.wait(1.0)
        return None

    def _probe(self, peer: str) -> dict | None:
        if self._unreachable.get(peer, 0) > time.monotonic():
            return None
        try:
            return self.client.probe(peer)
        except Exception as e:  # not a learner (the host), gone, or unreachable: not a leader to follow
            logger.debug("probing learner %s: %s", peer, e)
            self._unreachable[peer] = time.monotonic() + 60.0
            return None

    def _take_lead(self, why: str) -> None:
        s = self.session
        self.lead.lead(s.version, s.sha)
        self.leader, self.members, self._synced = None, [self.me], True
        self._bans_told = len(self.intake.banned)
        self._next_rival_check = time.monotonic() + RIVAL_CHECK_EVERY
        self.fetcher = Fetcher(self.store, s.spec.staleness.tau_max, self.config.poll_interval)
        self.fetcher.version = s.version
        self.fetcher.start()
        self.team_counts["led"] += 1
        logger.info("leading the learners at v%d (%s)", s.version, why)
        self._beat()

    def _follow(self, leader: str, same_team: bool = False) -> None:
        """Help ``leader``; ``same_team``: it took over the team this one was in (so they hold the same state)."""
        self._stop_fetcher()
        self.lead.follow(leader)
        self.leader, self._failed_calls = leader, 0
        self._synced = self._synced and same_team
        self.team_counts["followed"] += 1
        logger.info("helping learner %s, which leads", leader)
        self._beat()

    def _stop_fetcher(self) -> None:
        if self.fetcher is not None:
            self.fetcher.stop()
            self.fetcher = None

    def _help_once(self) -> None:
        """One request to the leader, and what its answer says to do (catch up, take a share, ask elsewhere)."""
        s = self.session
        try:
            answer = self.client.work(self.leader, s.version, s.sha, need_state=not self._synced)
        except Exception as e:  # the network boundary: the leader may be gone
            self._leader_unreachable(e)
            return
        self._failed_calls = 0
        if isinstance(answer.get("members"), list):
            self.members = [m for m in answer["members"] if isinstance(m, str)][:64]
        if "refused" in answer:
            raise UserError(f"the leading learner refuses this learner's work: {str(answer['refused'])[:200]}")
        if "leader" in answer:  # it does not lead (any more)
            hint = answer["leader"]
            if isinstance(hint, str) and hint not in (self.leader, self.me):
                self._follow(hint, same_team=True)
            else:
                self._succeed(f"learner {self.leader} stopped leading")
            return
        if "state" in answer:
            self._adopt_state(answer["state"])
        for step in answer.get("steps", []):
            self._apply_step(team.check_step(step))
        if "task" in answer:
            self._do_task(answer["task"])

    def _leader_unreachable(self, error: Exception) -> None:
        self._failed_calls += 1
        logger.warning("the leading learner %s did not answer: %s", self.leader, error)
        if self._failed_calls < 2:
            self._stop.wait(0.5)
            return
        self._succeed(f"learner {self.leader} is unreachable")

    def _succeed(self, why: str) -> None:
        """The leader is gone: the first member alive after it leads (this one, or one it then follows)."""
        gone = self.leader
        for member in [m for m in self.members if m != gone]:
            if member == self.me:
                self._take_lead(why)
                return
            deadline = time.monotonic() + TAKEOVER_WAIT
            while time.monotonic() < deadline and not self._stop.is_set():
                self._unreachable.pop(member, None)
                answer = self._probe(member)
                if answer is None:
                    break  # gone too: the next one
                if answer.get("leading"):
                    self._follow(member, same_team=True)
                    return
                hint = answer.get("leader")
                if isinstance(hint, str) and hint not in (gone, self.me, member) and self._probe(hint):
                    self._follow(hint, same_team=True)
                    return
                self._stop.wait(0.5)  # alive, not leading yet: it has not noticed
        self._take_lead(why)

    def _adopt_state(self, state: dict) -> None:
        """Take the leader's whole state (this learner was not in its recent lineage)."""
        s = self.session
        try:
            version, sha, blob = int(state["version"]), str(state["sha"]), bytes(state["adapter"])
            optimizer_state = torch.load(io.BytesIO(bytes(state["optimizer"])), weights_only=True)
            intake_state = dict(state["intake"])
        except Exception as e:  # whatever came over the wire: refuse it, ask again
            logger.warning("the leader's state is unreadable (%s); asking again", e)
            return
        if version < s.version:  # this learner holds a newer version: it leads, and the other will follow it
            self._take_lead(f"v{s.version} is newer than the leader's v{version}")
            return
        s.swap(version, sha, blob)
        self.optimizer.load_state_dict(optimizer_state)
        self._synced = True
        self.intake.pool.clear()
        self.intake.pending_checks()
        self.intake.known.clear()
        self.intake.restore(intake_state)
        self.window.clear()
        self._remember(version, sha)
        self._parent_of_resumed = str(state.get("parent") or "")
        self.announcer.submit(version, blob, self._parent_of_resumed, None)
        self.team_counts["states"] += 1
        logger.info("took the leading learner's state at v%d", version)
        self._beat()

    def _apply_step(self, step: dict) -> None:
        """Apply the leader's update: its clipped gradient through this learner's (identical) AdamW."""
        s = self.session
        if step["version"] != s.version + 1 or (step.get("parent") or "") != s.sha:
            logger.warning("step v%d does not follow v%d here: asking the leader again", step["version"], s.version)
            return
        t0 = time.perf_counter()
        grads = tensors_from_bytes(step["grads"], lora_parameters(s.model))
        apply_gradient(s.model, self.optimizer, grads, None)
        blob = adapter_to_bytes(s.model)
        sha = sha256_hex(blob)
        if sha != step["sha"]:  # a different torch build rounds differently: take the leader's adapter as it is
            self.team_counts["drifted"] += 1
            logger.warning(
                "v%d made here hashes to %s…, the leader's to %s…: taking the leader's",
                step["version"],
                sha[:12],
                step["sha"][:12],
            )
            blob = s.fetch_adapter(step["sha"], step["size"], [self.leader])
            load_adapter_bytes(s.model, blob, step["sha"])
            sha = step["sha"]
        self.intake.restore(step["intake"])
        self.team_counts["steps"] += 1
        record = dict(step["record"], applied_seconds=round(time.perf_counter() - t0, 4))
        self._advance(step.get("parent") or "", sha, blob, record, None)

    def _do_task(self, task: dict) -> None:
        """Compute the gradient of the leader's share for this learner and send it back."""
        s = self.session
        try:
            groups = [Accepted(bytes(g["owner"]), unpack(GroupRecord, bytes(g["group"]))) for g in task["groups"]]
            task_id = int(task["id"])
        except Exception as e:  # from the leader, but over the wire: refuse it
            logger.warning("an unreadable share from the leader (%s)", e)
            return
        share = share_gradient(s.model, batch_tensors(groups, s.version, s.spec, self._pad_id(), s.device), s.spec)
        if share is None:
            params = lora_parameters(s.model)
            share = Share([torch.zeros_like(p) for p in params], 0, {})
        try:
            self.client.result(self.leader, task_id, tensors_to_bytes(share.grads), share.tokens, share.stats)
            self.team_counts["shares"] += 1
        except Exception as e:  # the leader will compute the share itself
            logger.warning("could not send a share's gradient to the leader: %s", e)

    def _check_rivals(self) -> None:
        """Another learner leading a lineage of its own (two started at once)? The better one stays leader."""
        self._next_rival_check = time.monotonic() + RIVAL_CHECK_EVERY
        s = self.session
        mine = {**{v: sha for v, (sha, _) in self.window.items()}}
        helpers = set(self.lead.helpers())
        for _, r in announcements(s.swarm):
            if r.learner in helpers or r.learner == self.me or mine.get(r.version) == r.sha256:
                continue
            if r.version < s.version - team.KEEP_STEPS:
                continue
            answer = self._probe(r.learner)
            leads = answer and answer.get("leading") and isinstance(answer.get("version"), int)
            if leads and team.wins((answer["version"], r.learner), (s.version, self.me)):
                logger.warning("learner %s leads another lineage, at v%d: following it", r.learner, answer["version"])
                self._follow(r.learner)
                return

    def _beat(self) -> None:
        self.session.heartbeat.update(
            adapter_version=self.session.version,
            throughput=self._rate(),
            stats={
                "versions": float(self.made),
                "accepted": float(sum(h["groups"] for h in self.history)),
                "rejected": float(sum(self.intake.rejected.values())),
                "banned": float(len(self.intake.banned)),
                "waiting": float(self.intake.waiting()),
                "leading": 1.0 if self.leader is None else 0.0,
                "helpers": float(len(self.lead.helpers())) if self.leader is None else 0.0,
            },
        )

    # --- the loop --------------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def run(self, max_seconds: float | None = None) -> dict:
        """Learn until stopped, ``max_versions`` or ``max_seconds``; returns what was done."""
        s, c, intake = self.session, self.config, self.intake
        started = time.perf_counter()
        while not self._stop.is_set():
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                break
            if c.max_versions is not None and self.made >= c.max_versions:
                break
            if self.leader is not None:
                self._help_once()
                continue
            if self.lead.snapshot_wanted.is_set():
                self.lead.offer_snapshot(self._snapshot())
            if time.monotonic() >= self._next_rival_check:
                self._check_rivals()
                if self.leader is not None:
                    continue
            self._read(timeout=0.0)
            self._spot_check(minimum=SPOT_CHECK_BATCH)
            chosen = intake.take(s.version)
            if chosen is None:
                self._spot_check()  # the groups waiting for a check may be the ones missing
                chosen = intake.take(s.version)
            if chosen is None:
                self._read(timeout=c.poll_interval)  # too few groups: wait for the fetcher
                continue
            self._update(chosen)
        self.announcer.flush()
        seconds = time.perf_counter() - started
        if c.checkpoint_dir and self.made and self._checkpointed != frozenset({s.sha}):
            self._checkpoint()
        accepted = sum(h["groups"] for h in self.history)
        return {
            "versions_made": self.made,
            "adapter_version": s.version,
            "adapter_sha256": s.sha,
            "groups_accepted": accepted,
            "groups_dropped_stale": intake.counts["dropped_stale"],
            "groups_rejected": dict(intake.rejected),
            "ignored_banned": intake.counts["ignored_banned"],
            "banned": sorted(key_fingerprint(o) for o in intake.banned),
            "logprob_checks": intake.counts["checked"],
            "seconds": round(seconds, 3),
            "groups_per_second": round(accepted / seconds, 3) if seconds else 0.0,
            "step_seconds_mean": round(sum(self.step_seconds) / len(self.step_seconds), 4) if self.step_seconds else 0,
            "staleness_mean": round(sum(self.staleness) / len(self.staleness), 3) if self.staleness else 0.0,
            "staleness_max": max(self.staleness, default=0),
            "announce_failures": self.announcer.failures,
            "resumed_from": self.resumed_from,
            "peer_id": str(s.swarm.peer_id),
            "team": {
                "leading": self.leader is None,
                "leader": self.leader or self.me,
                "members": len(self.members),
                **{k: int(v) for k, v in sorted(self.team_counts.items())},
                **{f"served_{k}": int(v) for k, v in sorted(self.lead.stats.items())},
            },
        }

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

    def _spot_check(self, minimum: int = 1) -> None:
        """Recompute the behaviour log-probs of the sampled groups, each under the adapter version it claims, once
        at least ``minimum`` wait (checks are batched: one forward pass per version).

        An older version is visited by copying its LoRA tensors into the model and back (about a millisecond on the
        bundled model; loading and re-hashing the blob took 25 ms a visit): the bytes are this learner's own.
        """
        if self.intake.checks_waiting() < minimum:
            return
        pending = self.intake.pending_checks()
        if not pending:
            return
        s = self.session
        params = lora_parameters(s.model)
        try:
            for version in sorted({a.group.version for a in pending}):
                known = self.window.get(version)
                if known is None:  # too old to check any more: it will be dropped as stale
                    for a in pending:
                        if a.group.version == version:
                            self.intake.checked(a, None)
                    continue
                _copy_into(params, known[1])
                these = [a for a in pending if a.group.version == version]
                tolerance = self.config.logprob_tolerance
                for a, refused in zip(
                    these, check_logprobs_many(s.model, [a.group for a in these], s.spec, tolerance), strict=True
                ):
                    if refused is not None:
                        logger.warning("banned %s for this run: %s", key_fingerprint(a.owner), refused)
                    self.intake.checked(a, refused)
        finally:
            _copy_into(params, self.window[s.version][1])

    def _update(self, chosen: list[Accepted]) -> None:
        """Make version ``v + 1`` from ``chosen``: a share for each helper, the rest here, one AdamW step."""
        s, c = self.session, self.config
        t0 = time.perf_counter()
        helpers = self.lead.helpers()
        parts = _split(chosen, len(helpers) + 1)
        tasks: dict[int, tuple[str, list[Accepted]]] = {}
        for helper, part in zip(helpers, parts[1:], strict=True):
            if part:
                groups = [{"owner": a.owner, "group": pack(a.group)} for a in part]
                tasks[self.lead.assign(helper, groups)] = (helper, part)
        shares = [self._share(parts[0])]
        own_seconds = time.perf_counter() - t0
        received = self._collect(tasks, time.monotonic() + max(HELPER_MIN_WAIT, HELPER_WAIT_FACTOR * own_seconds))
        for task_id, (helper, part) in tasks.items():
            share = received.get(task_id)
            if share is None:
                self.lead.withdraw(helper)
                self.team_counts["shares_late"] += 1
                share = self._share(part)
            elif self._helper_results[helper] <= HELPER_PROBATION or self._rng.random() < c.check_rate:
                share = self._check_helper(helper, part, share)
            shares.append(share)
            self._helper_results[helper] += 1
        combined = combine(shares)
        taus = [s.version - a.group.version for a in chosen]
        self.staleness.extend(taus)
        if combined is None:  # every group's rewards were all equal: they are used, but nothing moves
            self._record(None, chosen, taus, time.perf_counter() - t0, None)
            return
        grad_norm = apply_gradient(s.model, self.optimizer, combined.grads, c.max_grad_norm)
        blob = adapter_to_bytes(s.model)
        parent, sha = s.sha, sha256_hex(blob)
        seconds = time.perf_counter() - t0
        self.step_seconds.append(seconds)
        stats = {**combined.stats, "grad_norm": grad_norm, "helpers": len(tasks)}
        record = self._record(parent, chosen, taus, seconds, stats, version=s.version + 1, sha=sha)
        banned = list(self.intake.banned.items())
        self.lead.advance(
            {
                "version": s.version + 1,
                "parent": parent,
                "sha": sha,
                "size": len(blob),
                "grads": tensors_to_bytes(combined.grads),
                "intake": {
                    "used": _used_of(chosen),
                    "banned": {o.hex(): why for o, why in banned[self._bans_told :]},
                },
                "record": dict(record, ids=[list(a.id) for a in chosen]),
            }
        )
        self._bans_told = len(banned)
        self._advance(parent, sha, blob, record, self._metrics(record))

    def _share(self, part: list[Accepted]) -> Share | None:
        s = self.session
        if not part:
            return None
        return share_gradient(s.model, batch_tensors(part, s.version, s.spec, self._pad_id(), s.device), s.spec)

    def _collect(self, tasks: dict, deadline: float) -> dict[int, Share]:
        """The helpers' gradients for ``tasks`` that arrive before ``deadline`` (checked; late ones are ignored)."""
        params = lora_parameters(self.session.model)
        received: dict[int, Share] = {}
        while len(received) < len(tasks):
            try:
                peer, task_id, grads, tokens, stats = self.lead.results.get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                break
            if task_id not in tasks or tasks[task_id][0] != peer:
                continue  # an answer to a task already done here
            try:
                names = ("loss", "clip_fraction", "ratio_mean", "ratio_max")
                stats = {**{k: float(stats[k]) for k in names}, "rows": int(stats["rows"])} if tokens else {}
                received[task_id] = Share(tensors_from_bytes(grads, params), tokens, stats)
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("learner %s sent an unreadable gradient (%s): computing its share here", peer, e)
        return received

    def _check_helper(self, helper: str, part: list[Accepted], share: Share) -> Share | None:
        """Recompute a helper's share here; a gradient that differs means it no longer helps this team."""
        self.team_counts["helper_checks"] += 1
        mine = self._share(part)
        if _same_gradient(mine, share):
            return mine
        self.team_counts["helpers_refused"] += 1
        why = "its gradient differs from the one recomputed by the leader"
        logger.warning("refusing learner %s: %s", helper, why)
        self.lead.refuse(helper, why)
        return mine

    def _advance(self, parent: str, sha: str, blob: bytes, record: dict, metrics: MetricsRecord | None) -> None:
        """The model now holds the next version (made here or applied from the leader): keep, announce, log it."""
        s, c = self.session, self.config
        s.version, s.sha, s.blob = s.version + 1, sha, blob
        self.made += 1
        self._remember(s.version, sha)
        if self.fetcher is not None:
            self.fetcher.version = s.version
        if self.leader is not None:  # applied: the leader's record, kept here too
            self.history.append(record)
            self._ledger(record)
        self.announcer.submit(s.version, blob, parent, metrics)
        self._beat()
        if c.checkpoint_dir and self.made % c.checkpoint_every == 0:
            self._checkpoint()

    def _snapshot(self) -> dict:
        """This learner's whole state, for a helper that is not in its recent lineage."""
        s = self.session
        buffer = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buffer)
        parent = self.history[-1]["parent_sha256"] if self.history else self._parent_of_resumed
        return {
            "version": s.version,
            "sha": s.sha,
            "parent": parent or "",
            "adapter": s.blob,
            "optimizer": buffer.getvalue(),
            "intake": self.intake.state(),
        }

    def _record(self, parent, chosen, taus, seconds, stats, version=None, sha=None) -> dict:
        s = self.session
        rewards = [r for a in chosen for r in a.group.rewards]
        record = {
            "version": s.version if version is None else version,
            "sha256": s.sha if sha is None else sha,
            "parent_sha256": parent,
            "time": time.time(),
            "groups": len(chosen),
            "staleness_mean": sum(taus) / len(taus),
            "staleness_max": max(taus),
            "reward_mean": sum(rewards) / len(rewards),
            "step_seconds": round(seconds, 4),
            "waiting": self.intake.waiting(),
            "dropped_stale": self.intake.counts["dropped_stale"],
            "rejected": dict(self.intake.rejected),
            "banned": sorted(key_fingerprint(o) for o in self.intake.banned),
            "per_peer": dict(Counter(key_fingerprint(a.owner) for a in chosen)),
            **(stats or {"no_signal": True}),
        }
        self.history.append(record)
        self.accepted_by.update(a.owner for a in chosen)
        if stats is not None:
            logger.info(
                "v%d: %d groups (tau mean %.2f max %d), reward %.3f, clip %.3f, ratio %.3f, step %.3fs%s",
                record["version"],
                len(chosen),
                record["staleness_mean"],
                record["staleness_max"],
                record["reward_mean"],
                stats["clip_fraction"],
                stats["ratio_mean"],
                seconds,
                f", {stats['helpers']} helpers" if stats.get("helpers") else "",
            )
        self._ledger(dict(record, ids=[list(a.id) for a in chosen]))
        return record

    def _ledger(self, line: dict) -> None:
        if self.config.ledger is not None:
            with open(self.config.ledger, "a") as f:
                f.write(json.dumps(line) + "\n")

    def _metrics(self, record: dict) -> MetricsRecord:
        banned = list(self.intake.banned)[-64:]  # the most recent bans
        return MetricsRecord(
            learner=str(self.session.swarm.peer_id),
            version=self.session.version,
            groups_accepted=sum(self.accepted_by.values()),  # its own updates' (status sums over learners)
            groups_dropped_stale=self.intake.counts["dropped_stale"],
            groups_rejected=dict(list(self.intake.rejected.items())[:16]),
            staleness_mean=float(record["staleness_mean"]),
            staleness_max=int(record["staleness_max"]),
            reward_mean=min(1.0, max(0.0, float(record["reward_mean"]))),
            exact_match=None,
            step_seconds=float(record["step_seconds"]),
            banned=[key_fingerprint(o) for o in banned],
            per_peer=self._tallies(),
            reward_history=[min(1.0, max(0.0, float(h["reward_mean"]))) for h in self.history[-MAX_HISTORY:]],
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
        recent = [h for h in self.history if h["time"] > time.time() - 30]
        if len(recent) < 2:
            return 0.0
        return sum(h["groups"] for h in recent[1:]) / max(1e-6, recent[-1]["time"] - recent[0]["time"])

    def _pad_id(self) -> int:
        t = self.session.tokenizer
        return t.pad_token_id if t.pad_token_id is not None else t.eos_token_id

    def _remember(self, version: int, sha: str) -> None:
        """Keep the window's versions (the model holds ``version`` now); drop older blobs from the cache too."""
        self.window[version] = (sha, [p.detach().clone() for p in lora_parameters(self.session.model)])
        self.intake.known[version] = sha
        oldest = version - self.session.spec.staleness.tau_max - KEEP_ADAPTERS
        for v in [v for v in self.window if v < oldest]:
            old_sha, _ = self.window.pop(v)
            if v > 0 and old_sha not in self._checkpointed:
                self.session.blobs.cache.remove(old_sha)

    def _checkpoint(self) -> None:
        s = self.session
        parent = self.history[-1]["parent_sha256"] if self.history else self._parent_of_resumed
        meta = {
            "run_id": self.config.run_id,
            "version": s.version,
            "sha256": s.sha,
            "parent_sha256": parent or "",
            "created": time.time(),
            **self.intake.state(),
        }
        write_checkpoint(self.config.checkpoint_dir, meta, s.blob, self.optimizer.state_dict())
        self._checkpointed = frozenset({s.sha})
        logger.info("checkpoint v%d written to %s", s.version, self.config.checkpoint_dir)

    def close(self) -> None:
        self._closers.close()

    def __enter__(self) -> LearnerPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive parts whose sizes differ by at most one (the first ones are the larger)."""
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


def _used_of(chosen: list[Accepted]) -> dict[str, list[list[int]]]:
    """The seqs an update used, in the form of :meth:`Intake.state` (helpers restore it)."""
    used: dict[str, list[list[int]]] = {}
    for a in chosen:
        used.setdefault(a.owner.hex(), []).append([a.group.seq, a.group.version])
    return used


def _same_gradient(a: Share | None, b: Share) -> bool:
    if a is None:
        return b.tokens == 0
    if a.tokens != b.tokens:
        return False
    scale = max(float(g.abs().max()) for g in a.grads) + 1e-8
    worst = max(float((x - y).abs().max()) for x, y in zip(a.grads, b.grads, strict=True))
    return worst <= GRADIENT_TOLERANCE * scale


def _copy_into(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def run_learner(config: LearnerConfig, on_ready=None) -> dict:
    """Start a learner, run it until stopped, close it; ``on_ready(peer)`` lets the caller install signals."""
    peer = LearnerPeer(config)
    try:
        peer.start()
        if on_ready is not None:
            on_ready(peer)
        result = None if peer.session.revoked else peer.run()
        if peer.session.revoked:  # the host revoked this peer's invite: the swarm refuses it from now on
            raise UserError(peer.session.revoked)
        return result
    finally:
        peer.close()


__all__ = ["LearnerConfig", "LearnerPeer", "batch_tensors", "learn_step", "read_checkpoint", "run_learner"]
