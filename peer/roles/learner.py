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

import json
import os
import queue
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peer.errors import UserError
from peer.grpo import clipped_policy_loss, completion_logprobs, group_advantages, staleness_weight
from peer.log import get_logger
from peer.model.adapter import adapter_to_bytes, lora_parameters, sha256_hex
from peer.network.swarm import NetworkConfig
from peer.protocol import MetricsRecord, PeerTally, key_fingerprint, metrics_key, owner_subkey, to_dht_value
from peer.protocol.limits import MAX_HISTORY, MAX_TALLIED
from peer.roles.adapters import announce_adapter
from peer.roles.closers import Closers
from peer.roles.intake import Accepted, Intake
from peer.roles.session import Session, SessionConfig, default_cache_dir, open_session
from peer.roles.verify import Refused, check_logprobs_many, pack_rows

logger = get_logger(__name__)

REANNOUNCE_EVERY = 120.0  # s; the announcement lives ANNOUNCEMENT_TTL (600 s): an idle learner stays findable
SPOT_CHECK_BATCH = 4  # log-prob checks wait until this many are due (or the update needs them)
KEEP_ADAPTERS = 2  # versions beyond the staleness window whose blobs stay in the cache (for slow followers)


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


@dataclass
class Batch:
    """The tensors of one update, rows prompt-major (row = group * G + completion)."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded
    completion_mask: torch.Tensor  # [B, C] bool
    behaviour: torch.Tensor  # [B, C] float32
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B] staleness weights
    rewards: torch.Tensor  # [groups, G]


def batch_tensors(accepted: list[Accepted], version: int, spec, pad_id: int, device) -> Batch:
    """Pack verified groups (and their staleness against ``version``) into the loss's layout."""
    behaviour, weights, rewards = [], [], []
    for a in accepted:
        g = a.group
        w = staleness_weight(version - g.version, spec.staleness)
        rewards.append(list(g.rewards))
        for c in g.completions:
            behaviour.append(c.behaviour_logprobs())
            weights.append(w)
    prompt_ids, prompt_mask, completion_ids, completion_mask = pack_rows([a.group for a in accepted], pad_id, device)
    C = completion_ids.shape[1]
    behaviour_t = torch.tensor([b + [0.0] * (C - len(b)) for b in behaviour], dtype=torch.float32)
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    advantages = group_advantages(rewards_t, spec.loss.adv_eps).flatten()
    return Batch(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        behaviour_t.to(device),
        advantages.to(device),
        torch.tensor(weights, dtype=torch.float32, device=device),
        rewards_t,
    )


def learn_step(model, batch: Batch, spec, optimizer, max_grad_norm: float) -> dict | None:
    """One clipped-loss AdamW step over the rows that carry signal; None when no row does (nothing to learn)."""
    rows = batch.advantages.ne(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    model.train()
    logprobs = completion_logprobs(
        model, batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows], spec.sampling.temperature
    )
    ref = None
    if spec.loss.kl_beta > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = completion_logprobs(
                model,
                batch.prompt_ids[rows],
                batch.prompt_mask[rows],
                batch.completion_ids[rows],
                spec.sampling.temperature,
            )
    loss, stats = clipped_policy_loss(
        logprobs,
        batch.behaviour[rows],
        batch.advantages[rows],
        batch.completion_mask[rows],
        batch.weights[rows],
        spec.loss,
        ref,
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(lora_parameters(model), max_grad_norm)
    optimizer.step()
    model.eval()
    return {
        "loss": stats.loss,
        "clip_fraction": stats.clip_fraction,
        "ratio_mean": stats.ratio_mean,
        "ratio_max": stats.ratio_max,
        "grad_norm": float(grad_norm),
        "rows": int(rows.numel()),
    }


class _Fetcher:
    """Reads the buckets of the staleness window on a thread; hands each new entry over exactly once.

    Every poll reads the newest two versions' buckets (where rollout peers publish); the whole window every
    ``FULL_EVERY`` polls (the late groups of slow peers); and a version's bucket once more as it leaves the window,
    so nothing published into the window goes unread — a late replay is still caught, though its group is too old
    to use. (Reading the whole window every poll made the learner's DHT process the busiest process of the demo:
    every read fetches and validates every entry of every bucket again.)
    """

    FULL_EVERY = 8

    def __init__(self, store, window: int, interval: float):
        self.store = store
        self.window = window
        self.interval = interval
        self.version = 0
        self.queue: queue.Queue = queue.Queue()
        self.errors = 0
        self._seen: set = set()
        self._polls, self._last = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bucket-fetcher", daemon=True)

    def start(self) -> _Fetcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def poll(self) -> None:
        """One read: the newest versions, the whole window every ``FULL_EVERY``-th time, the versions leaving."""
        version = self.version
        depth = self.window if self._polls % self.FULL_EVERY == 0 else min(1, self.window)
        self._polls += 1
        hi = version - self.window - 1  # the versions that left the window since the last poll: their last read
        lo = max(0, self._last - self.window, hi - self.FULL_EVERY + 1)  # a jump (a resume) reads a few, not all
        try:
            fetched = self.store.fetch(max(0, version - depth), version, self._seen)
            if hi >= lo:
                fetched += self.store.fetch(lo, hi, self._seen)
            self._last = version
        except Exception as e:  # the network boundary: say it, try again
            self.errors += 1
            logger.warning("could not read the buckets: %s", e)
            fetched = []
        for f in fetched:
            self._seen.add(f.id)
            self.queue.put(f)
        oldest = version - self.window - 2
        self._seen = {i for i in self._seen if i[1] >= oldest}


class _Announcer:
    """Announces the newest version (and the metrics) on a thread, so the learner never waits on the DHT; an
    older version not yet announced when a newer one is ready is skipped (followers want the newest)."""

    def __init__(self, swarm, blobs):
        self.swarm = swarm
        self.blobs = blobs
        self.announced = -1
        self.failures = 0
        self._pending: tuple | None = None
        self._current: tuple | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-announcer", daemon=True)
        self._thread.start()

    def submit(self, version: int, blob: bytes, parent_sha: str, metrics: MetricsRecord | None) -> None:
        with self._lock:
            self._pending = (version, blob, parent_sha, metrics)
            self._idle.clear()
        self._wake.set()

    def flush(self, timeout: float = 30.0) -> bool:
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(timeout=REANNOUNCE_EVERY)
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is None:
                if self._current is not None and time.monotonic() - last >= REANNOUNCE_EVERY:
                    pending = self._current
                else:
                    self._idle.set()
                    continue
            version, blob, parent, metrics = pending
            try:
                announce_adapter(self.swarm, self.blobs, version, blob, parent)
                self.announced, self._current, last = version, pending, time.monotonic()
                if metrics is not None:
                    self.swarm.store(
                        metrics_key(self.swarm.run_id),
                        owner_subkey(self.swarm.public_key),
                        to_dht_value(metrics),
                        time.time() + 600.0,
                        "learner metrics",
                    )
            except Exception as e:  # the network boundary: keep learning; the next version is announced anyway
                self.failures += 1
                logger.warning("could not announce adapter v%d: %s", version, e)
            with self._lock:
                if self._pending is None:
                    self._idle.set()


class LearnerPeer:
    """One learner: :meth:`start`, :meth:`run` (the loop), :meth:`close`."""

    def __init__(self, config: LearnerConfig):
        self.config = config
        self._stop = threading.Event()
        self._closers = Closers()
        self.session: Session | None = None
        self.intake: Intake | None = None
        self.optimizer = None
        # per version of the window: its sha256 and a copy of its LoRA tensors (spot checks visit old versions)
        self.window: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self.made = 0  # versions made by this run of the learner
        self.step_seconds: list[float] = []
        self.staleness: list[int] = []
        self.history: list[dict] = []
        self.accepted_by: Counter = Counter()  # signer -> groups used in an update
        self.resumed_from: str = "swarm"
        self._checkpointed: frozenset = frozenset()  # the sha256 of the adapter in the checkpoint (kept cached)
        self._parent_of_resumed = ""

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
        self.fetcher = _Fetcher(self.store, spec.staleness.tau_max, c.poll_interval)
        self.fetcher.version = s.version
        self.fetcher.start()
        self._closers.add(self.fetcher.stop)
        self.announcer = _Announcer(s.swarm, s.blobs)
        self._closers.add(self.announcer.close)
        if s.version > 0:  # what it resumed from is served and announced by this learner too
            self.announcer.submit(s.version, s.blob, self._parent_of_resumed, None)
        s.heartbeat.update(state="running", adapter_version=s.version)
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
        s, c = self.session, self.config
        t0 = time.perf_counter()
        batch = batch_tensors(chosen, s.version, s.spec, self._pad_id(), s.device)
        stats = learn_step(s.model, batch, s.spec, self.optimizer, c.max_grad_norm)
        taus = [s.version - a.group.version for a in chosen]
        self.staleness.extend(taus)
        if stats is None:  # every group's rewards were all equal: they are used, but nothing moves
            self._record(None, chosen, taus, batch, time.perf_counter() - t0, None)
            return
        blob = adapter_to_bytes(s.model)
        parent, sha = s.sha, sha256_hex(blob)
        s.version, s.sha, s.blob = s.version + 1, sha, blob
        self.made += 1
        self._remember(s.version, sha)
        seconds = time.perf_counter() - t0
        self.step_seconds.append(seconds)
        self.fetcher.version = s.version
        record = self._record(parent, chosen, taus, batch, seconds, stats)
        self.announcer.submit(s.version, blob, parent, self._metrics(record))
        s.heartbeat.update(
            adapter_version=s.version,
            throughput=self._rate(),
            stats={
                "versions": float(self.made),
                "accepted": float(sum(h["groups"] for h in self.history)),
                "rejected": float(sum(self.intake.rejected.values())),
                "banned": float(len(self.intake.banned)),
                "waiting": float(self.intake.waiting()),
            },
        )
        if c.checkpoint_dir and self.made % c.checkpoint_every == 0:
            self._checkpoint()

    def _record(self, parent, chosen, taus, batch, seconds, stats) -> dict:
        s = self.session
        record = {
            "version": s.version,
            "sha256": s.sha,
            "parent_sha256": parent,
            "time": time.time(),
            "groups": len(chosen),
            "staleness_mean": sum(taus) / len(taus),
            "staleness_max": max(taus),
            "reward_mean": float(batch.rewards.mean()),
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
                "v%d: %d groups (tau mean %.2f max %d), reward %.3f, clip %.3f, ratio %.3f, step %.3fs",
                s.version,
                len(chosen),
                record["staleness_mean"],
                record["staleness_max"],
                record["reward_mean"],
                stats["clip_fraction"],
                stats["ratio_mean"],
                seconds,
            )
        if self.config.ledger is not None:
            line = dict(record, ids=[list(a.id) for a in chosen])
            with open(self.config.ledger, "a") as f:
                f.write(json.dumps(line) + "\n")
        return record

    def _metrics(self, record: dict) -> MetricsRecord:
        banned = list(self.intake.banned)[-64:]  # the most recent bans
        return MetricsRecord(
            learner=str(self.session.swarm.peer_id),
            version=self.session.version,
            groups_accepted=sum(h["groups"] for h in self.history),
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


def _copy_into(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


# --- checkpoints ---------------------------------------------------------------------------------------------------

CHECKPOINT_META = "checkpoint.json"


def write_checkpoint(directory: Path, meta: dict, adapter: bytes, optimizer_state: dict) -> None:
    """Write ``directory/{checkpoint.json, adapter.safetensors, optimizer.pt}`` atomically (a crash mid-write
    leaves the previous checkpoint whole)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / "adapter.safetensors").write_bytes(adapter)
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
        blob = (directory / "adapter.safetensors").read_bytes()
        if sha256_hex(blob) != meta["sha256"]:
            raise ValueError(f"adapter.safetensors hashes to {sha256_hex(blob)[:12]}…, not {meta['sha256'][:12]}…")
        optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
        int(meta["version"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(
            f"the checkpoint in {directory} is unreadable ({e}); move it away to resume from the swarm instead"
        ) from e
    return meta, blob, optimizer_state


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
