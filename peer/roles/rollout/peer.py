"""The rollout peer (``hivegrpo join``): sample and score GRPO groups with the newest adapter, publish them.

Start-up: join the swarm, read the manifest, get the base model files (local, then P2P, then the hub; see
:mod:`peer.run.basemodel`), load the base quantized as the manifest says, attach LoRA and load the newest
announced adapter. Then, batch after batch, never waiting for a learner:

1. between two batches, hot-swap to a newer adapter if the follower thread has prefetched one, and check that
   the adapter now in the model hashes to the announced sha256 (else stop loudly: the groups would lie);
2. *pacing*: the newest admitted announcement says what its learner consumes (groups/s, what it holds, how many
   producers): this peer makes its share of that (:class:`Pacer`), so groups made ≈ groups used. Until a learner
   has measured it, *backpressure*: if the bucket of the newest version already holds ``max_inflight`` groups (by
   default twice what the learners consume per version), wait — those would only be consumed later or dropped;
3. take the next ``batch_size`` sequence numbers; the prompts are ``task.example(prompt_seed(run_seed, key), seq)``
   so learners can regenerate them; sample G completions each with their behaviour log-probs (out of memory, or
   over ``--max-memory`` by the estimate, the batch is halved and the same prompts retried: :mod:`peer.model.memory`);
4. hand the batch to the publisher (:mod:`peer.roles.rollout.publisher`: a child process scores it and builds the
   records and entries, a thread here stores them; sampling goes on meanwhile), and report throughput in the
   heartbeat.

SIGINT/SIGTERM (:meth:`RolloutPeer.request_stop`) ends the loop after the current batch; the queued groups are
published, the heartbeat announces ``leaving``, and everything started is shut down.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from peer.children import lower_priority
from peer.closers import Closers
from peer.errors import UserError
from peer.log import get_logger
from peer.model.adapter import AdapterError
from peer.model.memory import (
    CPU_BATCH_CAP,
    CUDA_BATCH_CAP,
    SAMPLED_PROMPTS,
    auto_batch_size,
    compute_dtype,
    in_batches,
    memory_budget,
    mib,
    row_bytes,
)
from peer.model.merge import MergedLoRA
from peer.model.sampling import Completions, encode_prompts, sample_groups
from peer.network.swarm import NetworkConfig
from peer.protocol import BUCKET_RING, GroupRecord, key_fingerprint
from peer.roles.rollout.groups import build_groups
from peer.roles.rollout.pacing import (
    DEMAND_FRESH_FACTOR,
    DEMAND_FRESH_SLACK,
    OWN_PER_VERSION,
    POOL_TARGET,
    Backlog,
    Pacer,
    Pacing,
)
from peer.roles.rollout.progress import PROGRESS_EVERY, Counters, OwnCredit, Progress
from peer.roles.rollout.publisher import MAX_GATHERED_GROUPS, Publisher, Sampled
from peer.roles.supervisor import supervise
from peer.run.adapters import REDEMAND_EVERY, AdapterFollower
from peer.run.session import Session, SessionConfig, default_cache_dir, open_session, settle_process
from peer.run.spec import RunSpec, sampling_seed

logger = get_logger(__name__)

BUCKET_EXPIRATION = 600.0  # s a bucket entry lives at most (docs/protocol.md, key table)
MIN_BUCKET_EXPIRATION = 60.0  # s it lives at least: ample for the staleness window and clocks a minute apart


def bucket_expiration(version_interval: float) -> float:
    """How long this peer's bucket entries live, given the seconds between versions (0: not known yet): as long as
    ``BUCKET_RING - 2`` versions take, so that an entry is gone about when its ring slot comes round again (readers
    of the slot would otherwise be sent the old versions' entries on every read), within
    [``MIN_BUCKET_EXPIRATION``, ``BUCKET_EXPIRATION``]; the longest while the interval is not known."""
    if version_interval <= 0:
        return BUCKET_EXPIRATION
    return min(BUCKET_EXPIRATION, max(MIN_BUCKET_EXPIRATION, (BUCKET_RING - 2) * version_interval))


LINGER_SHARE = 0.1  # the share of the time between versions the publisher gathers groups for, at most


def publish_linger(most: float, version_interval: float) -> float:
    """Seconds the publisher gathers a batch's groups with the next ones into one store: ``most``, but no more than
    ``LINGER_SHARE`` of the seconds between versions (0: not known yet). Gathering makes fewer, fuller entries, and
    delays each group by as much: on a small model, where versions come every 0.4 s, 0.25 s was most of a
    version's worth of staleness on every group (docs/rollout.md, "Measured")."""
    if version_interval <= 0:
        return most
    return min(most, LINGER_SHARE * version_interval)


@dataclass(frozen=True)
class RolloutConfig:
    run_id: str
    network: NetworkConfig = field(default_factory=NetworkConfig)
    coordinator: str | None = None  # fingerprint of the host's key; None: the only manifest there is
    quantization: str | None = None  # None: as the manifest says
    device: str = "auto"
    dtype: str = "auto"  # compute dtype: auto, float32, bfloat16 or float16
    batch_size: int | None = None  # prompts per batch; None: sized to free memory
    max_memory: int | None = None  # bytes the model and a batch may take (--max-memory); None: what is free
    max_groups: int | None = None  # stop after publishing this many
    max_inflight: int | None = None  # groups at the newest version before waiting; None: 2 x groups_per_version
    nice: int = 0  # once ready, lower this process (and its DHT process, p2pd, session) to this nice value
    cache_dir: Path = field(default_factory=default_cache_dir)
    heartbeat_interval: float = 10.0
    allowed_tasks: tuple[str, ...] = ()  # plug-in task modules the manifest may name (--allow-task)
    poll_interval: float = 0.5
    publish_linger: float = 0.25  # seconds the publisher gathers groups into one store at most (publish_linger())
    ledger: Path | None = None  # JSON lines: one per batch and one per adapter swap
    metrics_port: int | None = None  # serve Prometheus metrics at http://metrics_host:PORT/metrics (0: any free port)
    metrics_host: str = "127.0.0.1"  # the address the metrics are served on
    name: str | None = None  # this peer's --name: in its heartbeat, so status and the credit table show it
    max_upload: float | None = None  # bytes/s its blob server sends at most (--max-upload); None: no limit
    progress_every: float = PROGRESS_EVERY  # s between two progress lines (peer.roles.rollout.progress)

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_groups is not None and self.max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {self.max_groups}")
        if self.max_memory is not None and (not isinstance(self.max_memory, int) or self.max_memory < 1):
            raise ValueError(f"max_memory must be a positive number of bytes, got {self.max_memory!r}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in 0..19, got {self.nice}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0: any free port), got {self.metrics_port}")

    def session_config(self) -> SessionConfig:
        return SessionConfig.of(self)


def recent_rate(window: list[tuple[float, int]], elapsed: float) -> float:
    """Completions per second from ``(end time, completions)`` of the recent batches, waits included.

    The span opens at the first batch's end, so that batch's own completions are outside it; a single batch gives
    its own rate (``elapsed``: its sampling time).
    """
    if len(window) < 2:
        return window[-1][1] / max(elapsed, 1e-9)
    return sum(k for _, k in window[1:]) / max(window[-1][0] - window[0][0], 1e-9)


class _SeqCounter:
    """Next sequence number, kept beside the identity file so a restarted peer never reuses one."""

    def __init__(self, identity_path: str | None, run_id: str):
        self.path = Path(f"{identity_path}.{run_id}.seq") if identity_path else None
        self.next = 0
        if self.path is not None and self.path.exists():
            try:
                self.next = int(json.loads(self.path.read_text())["next"])
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{self.path} is unreadable ({e}); delete it to start numbering afresh") from e

    def reserve(self, n: int) -> range:
        first = self.next
        self.next += n
        if self.path is not None:  # written before the groups exist: a crash skips numbers, never repeats them
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"next": self.next}))
            tmp.replace(self.path)
        return range(first, self.next)


@dataclass(frozen=True)
class RolloutSummary:
    """What :meth:`RolloutPeer.run` did (``hivegrpo join`` prints it; ``--json`` prints :meth:`to_json`)."""

    groups: int  # groups made
    published: int  # groups stored in the DHT
    publish_failed: int
    completions: int
    tokens: int  # completion tokens sampled
    seconds: float
    sample_seconds: float
    score_seconds: float
    waited_seconds: float  # paused for the learners (pacing, backpressure)
    completions_per_second: float
    adapter_version: int  # the version held at the end
    versions_used: list[int]  # every adapter version a batch was sampled with
    batch_size: int
    peer_id: str

    def to_json(self) -> dict:
        return asdict(self)


class RolloutPeer:
    """One rollout peer: :meth:`start` (join, manifest, model, adapter), :meth:`run` (the loop), :meth:`close`."""

    MAX_PAUSE = 15.0  # s of backpressure before one more batch regardless

    def __init__(self, config: RolloutConfig, pacing: Pacing | None = None):
        self.config = config
        self.pacing = pacing or Pacing()
        self._stop = threading.Event()
        self._closers = Closers()
        self.session: Session | None = None
        self.swarm = self.blobs = self.heartbeat = self.follower = self.publisher = None
        self.spec: RunSpec | None = None
        self.model = self.tokenizer = self.device = None
        self.sampler = sample_groups  # replaceable in tests (e.g. one that runs out of memory above some size)
        self.stats = {
            "groups": 0,
            "completions": 0,
            "batches": 0,
            "waited_s": 0.0,
            "swaps": 0,
            "sample_s": 0.0,
            "decode_s": 0.0,
            "tokens": 0,
        }
        self.versions_used: set[int] = set()
        self.drain_seconds = 0.0
        self.lag = (0.0, 0)  # (sum over groups made of versions behind the newest announced, groups): progress
        self.progress: Progress | None = None

    # --- start-up ------------------------------------------------------------------------------------------------

    def start(self) -> RolloutPeer:
        from peer.network.buckets import DHTBucketStore
        from peer.network.heartbeat import Reachable

        c = self.config
        if c.metrics_port is not None:  # first: a port in use fails before anything is loaded
            from peer.metrics import RolloutCollector, serve_metrics

            self._closers.add(serve_metrics(RolloutCollector(self), c.metrics_host, c.metrics_port).close)
        self.session = session = open_session(c.session_config(), "rollout", self._closers)
        self.session.on_revoked.append(self.request_stop)
        self.swarm, self.blobs, self.heartbeat = session.swarm, session.blobs, session.heartbeat
        self.spec = session.spec
        self.model, self.tokenizer, self.device = session.model, session.tokenizer, session.device
        session.merged = MergedLoRA.of(self.model, c.max_memory)  # before the batch size: its copy counts
        spec = self.spec
        self.batch_size = c.batch_size or self._auto_batch()
        self.max_inflight = c.max_inflight or 2 * spec.groups_per_version
        if self.max_inflight < spec.groups_per_version:
            logger.warning(
                "--max-inflight %d is below the %d groups a learner needs per version: it would wait forever for "
                "them; pausing at %d instead",
                self.max_inflight,
                spec.groups_per_version,
                spec.groups_per_version,
            )
            self.max_inflight = spec.groups_per_version
        self.seqs = _SeqCounter(c.network.identity_path, c.run_id)
        self.follower = AdapterFollower(
            self.swarm,
            self.blobs,
            self.version,
            interval=c.poll_interval,
            others=self.session.providers,
            admitted=session.admitted,
            check=session.check_adapter,
            held_sha=session.sha,
        ).start()
        self._closers.add(self.follower.stop)
        settle_process()  # no collector pauses, short GIL hold-ups for the sampler (docs/rollout.md)
        self.publisher = Publisher(  # forks: everything the scoring needs is loaded by now, and frozen
            DHTBucketStore(
                self.swarm,
                self.blobs,
                expiration=lambda: bucket_expiration(self.follower.version_interval),
                push_to=Reachable(self.swarm, "learner", admitted=session.admitted),
            ),
            # batches handed over and not yet stored before the sampler waits: room for a gathered run being
            # stored, the next ones gathering, and a slow store (p50 20 ms, but up to 0.9 s seen on loopback)
            max(4, 4 * -(-MAX_GATHERED_GROUPS // self.batch_size)),
            self.score,
            linger=lambda: publish_linger(c.publish_linger, self.follower.version_interval),
        )
        self._closers.add(self.publisher.close)
        self.store = self.publisher.store
        self.backlog = Backlog(self.store, c.poll_interval, near=self.max_inflight // 2)
        self.pacer = Pacer(POOL_TARGET * spec.groups_per_version)
        self.own_bound = max(self.max_inflight, OWN_PER_VERSION * spec.groups_per_version)
        self._closers.add(self.backlog.stop)
        self.heartbeat.update(
            state="running", adapter_version=self.version, stats={"batch_size": float(self.batch_size)}
        )
        self._ledger(
            kind="start",
            signer=key_fingerprint(self.swarm.public_key),
            peer_id=str(self.swarm.peer_id),
            version=self.version,
            batch_size=self.batch_size,
        )
        logger.info(
            "rollout peer ready: adapter v%d, %d prompt(s) x %d per batch, waits at %d groups per version",
            self.version,
            self.batch_size,
            spec.sampling.group_size,
            self.max_inflight,
        )
        if c.nice:  # joined at full priority (a late start costs the swarm groups); samples at the one asked for
            lower_priority(c.nice)
        self.progress = Progress(self._counters, self._own_credit, every=c.progress_every).start()
        self._closers.add(self.progress.stop)
        return self

    def _counters(self) -> Counters:
        lag_sum, lag_groups = self.lag
        return Counters(self.version, self.stats["groups"], lag_sum, lag_groups)

    def _own_credit(self) -> OwnCredit:
        """This peer's row of the admitted learners' credit records, merged by maximum (one DHT get)."""
        from peer.run.credit import admitted_credits, merged

        records = admitted_credits(self.swarm, self.session.admitted)
        own = merged([record for _, record in records]).get(key_fingerprint(self.swarm.public_key))
        if own is None:
            return OwnCredit(records=len(records))
        reasons = tuple(sorted(own.reasons.items(), key=lambda rn: (-rn[1], rn[0])))
        return OwnCredit(len(records), own.used, own.refused, reasons, own.stale, own.no_signal)

    @property
    def version(self) -> int:
        return self.session.version if self.session is not None else -1

    @property
    def sha(self) -> str:
        return self.session.sha if self.session is not None else ""

    @property
    def swap_seconds(self) -> list[float]:
        return self.session.swap_seconds if self.session is not None else []

    def _prompt_tokens(self, prompts: list[str]) -> int:
        """The longest of ``prompts`` in tokens, rendered as the sampler renders them (the batch's padded width)."""
        ids, _ = encode_prompts(self.tokenizer, prompts, torch.device("cpu"), self.spec.prompt)
        return int(ids.shape[1])

    def _auto_batch(self) -> int:
        s, owner = self.spec.sampling, self.swarm.public_key
        longest = self._prompt_tokens([self.spec.example(owner, i).prompt for i in range(SAMPLED_PROMPTS)])
        return auto_batch_size(
            self.model, self.device, s.group_size, longest, s.max_new_tokens, self.config.max_memory
        )

    def _over_budget(self, prompts: list[str]) -> str | None:
        """Why a batch of ``prompts`` must not be tried (its estimate exceeds ``--max-memory``), or None."""
        if self.config.max_memory is None:
            return None
        s = self.spec.sampling
        per_row = row_bytes(
            self.model.config, compute_dtype(self.model), self._prompt_tokens(prompts), s.max_new_tokens
        )
        need = per_row * len(prompts) * s.group_size
        budget, _ = memory_budget(self.model, self.device, self.config.max_memory)
        if need <= budget:
            return None
        return f"estimated {mib(need)}, --max-memory leaves {mib(budget)}"

    def sample(self, examples: list, seqs: range, generator: torch.Generator) -> list[tuple[range, Completions]]:
        """Sample the groups of ``seqs`` in batches of at most ``batch_size`` prompts, halving it (kept for the
        next batches) when memory runs out or ``--max-memory`` would be exceeded (:func:`in_batches`)."""
        s = self.spec.sampling

        def one(start: int, stop: int) -> tuple[range, Completions]:
            generator.manual_seed(sampling_seed(self.spec.seed, self.swarm.public_key, seqs[start]))
            return seqs[start:stop], self.sampler(
                self.model,
                self.tokenizer,
                [e.prompt for e in examples[start:stop]],
                group_size=s.group_size,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                device=self.device,
                generator=generator,
                prompt=self.spec.prompt,
            )

        batches, self.batch_size = in_batches(
            one,
            len(seqs),
            self.batch_size,
            check=lambda start, stop: self._over_budget([e.prompt for e in examples[start:stop]]),
        )
        return batches

    # --- the loop ------------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()
        if self.follower is not None:
            self.follower._wake.set()

    def _swap(self, version: int, sha: str, blob: bytes, announced: float = 0.0) -> None:
        held = self.version
        self.session.swap(version, sha, blob)
        self.stats["swaps"] += 1
        if self.follower is not None:
            self.follower.mark_held(version, sha)
        logger.debug("now sampling with adapter v%d (%s…)", version, sha[:12])  # the progress line says it
        f = self.follower
        self._ledger(
            kind="swap",
            version=version,
            sha256=sha,
            held=held,
            announced=announced,
            size=len(blob),
            fetched_bytes=f.received.bytes if f else 0,
            served_bytes=getattr(self.blobs, "served_bytes", 0),
            fetched_at=f.fetched_at[1] if f and f.fetched_at[0] == version else None,
            fetches=f.fetches if f else 0,
        )

    def _follow(self) -> bool:
        ready = self.follower.take()
        if ready is None:
            return False
        announcement, blob = ready
        if announcement.version > self.version:
            held = (self.version, self.sha, self.session.blob)
            try:
                self._swap(announcement.version, announcement.sha256, blob, announcement.created)
            except AdapterError as e:  # a refused version, never an exit: go on with the adapter held
                self.follower.refuse(announcement.sha256, str(e))
                self.session.swap(*held)  # the model may hold part of the refused one
                return False
            return True
        return False

    def _ledger(self, **line) -> None:
        if self.config.ledger is not None:
            with open(self.config.ledger, "a") as f:
                f.write(json.dumps({"time": time.time(), **line}) + "\n")

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` or until asked to stop (a :class:`Pacing`'s)."""
        self._stop.wait(seconds)

    def wait_for_newer(self, version: int) -> None:
        """Wait until a version newer than ``version`` is in (at most ``MAX_PAUSE`` seconds, as backpressure does; a
        :class:`Pacing`'s)."""
        paused = time.perf_counter()
        while not self._stop.is_set() and self.version <= version:
            if time.perf_counter() - paused >= self.MAX_PAUSE:
                return
            start = time.perf_counter()
            self.follower.wait(0.5)
            self.stats["waited_s"] += time.perf_counter() - start
            self._follow()

    def _wait_for_learners(self) -> None:
        """Pace to the learners' demand when their newest announcement carries one (:class:`Pacer`): only an admitted
        learner can slow this peer down. Without one, backpressure: while the newest version's bucket is full, wait
        for a new version (or a stop). Either waits at most ``MAX_PAUSE`` seconds, then one more batch: a learner
        that used the groups up without making a version (no signal) must get new ones, or the swarm would stall."""
        said = False
        paused = time.perf_counter()
        while not self._stop.is_set():
            demand = getattr(self.follower, "demand", None)
            paced = demand is not None and demand.groups_per_second > 0 and self._demand_is_fresh(demand)
            self.backlog.active = not paced  # the bucket is counted only while it decides
            if paced:
                delay = self.pacer.wait(demand, time.perf_counter())
                own = self.backlog.enqueued_in(self.version, self.version)  # a bound on its own per version:
                if delay <= 0 and own < self.own_bound:  # the learners may have stopped since their last word
                    return
                step = min(delay, 0.5) if delay > 0 else 0.5  # the demand may change: look again every 0.5 s
            else:
                self.backlog.version = self.version
                if self.backlog.estimate(self.version) < self.max_inflight:
                    return
                step = 1.0
                if not said:
                    logger.info("%d groups of v%d wait for the learners; pausing", self.max_inflight, self.version)
                    said = True
            if time.perf_counter() - paused >= self.MAX_PAUSE:
                logger.info("no new version for %.0f s; sampling one more batch of v%d", self.MAX_PAUSE, self.version)
                return
            start = time.perf_counter()
            self.follower.wait(step)
            self.stats["waited_s"] += time.perf_counter() - start
            if self._follow() and not paced:
                return

    def _demand_is_fresh(self, demand) -> bool:
        """Whether the newest version (or the learner's re-announcement of it, every ``REDEMAND_EVERY`` s while it
        waits for groups) came recently enough for its demand to hold: within 3 times the interval between versions
        the demand implies (at least ``REDEMAND_EVERY``), plus 1 s. A learner that stopped announces nothing new;
        its last demand must not keep the peer making groups nobody will use."""
        interval = max(self.spec.groups_per_version / demand.groups_per_second, REDEMAND_EVERY)
        seen = getattr(self.follower, "demand_seen", 0.0)
        return time.monotonic() - seen <= DEMAND_FRESH_FACTOR * interval + DEMAND_FRESH_SLACK

    def score(self, sampled: Sampled) -> list[GroupRecord]:
        """Rewards and records of a sampled batch (the publisher's process calls it)."""
        spec, G = self.spec, self.spec.sampling.group_size
        texts = sampled.batch.texts(self.tokenizer, spec.prompt.stop)
        rewards = [spec.task.reward(t, sampled.examples[i // G]) for i, t in enumerate(texts)]
        owner, producer = self.swarm.public_key, str(self.swarm.peer_id)
        return build_groups(
            sampled.batch,
            rewards,
            sampled.seqs,
            spec,
            version=sampled.version,
            sha=sampled.sha,
            owner=owner,
            producer=producer,
        )

    def run(self, max_seconds: float | None = None) -> RolloutSummary:
        """Sample, score and publish until stopped, ``max_groups``, or ``max_seconds``; returns what was done
        (counts are totals since :meth:`start`; the groups made are all published when it returns)."""
        c, spec, s = self.config, self.spec, self.spec.sampling
        owner, producer = self.swarm.public_key, str(self.swarm.peer_id)
        generator = torch.Generator(device=self.device)
        started = time.perf_counter()
        window: list[tuple[float, int]] = []
        while not self._stop.is_set():
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                break
            self._follow()
            self._wait_for_learners()
            self.pacing.before_batch(self)
            if self._stop.is_set():
                break
            n = self.batch_size
            if c.max_groups is not None:
                n = min(n, c.max_groups - self.stats["groups"])
                if n <= 0:
                    break
            seqs = self.seqs.reserve(n)
            examples = [spec.example(owner, seq) for seq in seqs]
            t0 = time.perf_counter()
            self.pacer.started(t0, n)
            sampled = self.sample(examples, seqs, generator)  # one batch, or several after running out of memory
            self.stats["decode_s"] += time.perf_counter() - t0
            self.pacing.after_sampling(self, t0)
            self.backlog.enqueued(self.version, n)
            for part, batch in sampled:  # scored on the publisher's thread
                these = examples[part.start - seqs.start : part.stop - seqs.start]
                self.publisher.put(Sampled(batch, these, part, self.version, self.sha))
            elapsed = time.perf_counter() - t0
            self.versions_used.add(self.version)
            newest = self.follower.latest_seen.version if self.follower.latest_seen is not None else self.version
            self.lag = (self.lag[0] + n * max(0, newest - self.version), self.lag[1] + n)
            tokens = sum(int(batch.completion_mask.sum()) for _, batch in sampled)
            self.stats["tokens"] += tokens
            self._ledger(
                kind="batch",
                version=self.version,
                groups=n,
                completions=n * s.group_size,
                tokens=tokens,
                sample_seconds=round(elapsed, 4),
            )
            self.stats["groups"] += n
            self.stats["completions"] += n * s.group_size
            self.stats["batches"] += 1
            self.stats["sample_s"] += elapsed
            window = [(t, k) for t, k in window if t > time.perf_counter() - 30] + [
                (time.perf_counter(), n * s.group_size)
            ]
            self.heartbeat.update(
                throughput=recent_rate(window, elapsed),
                stats={k: float(v) for k, v in self.stats.items()} | {"batch_size": float(self.batch_size)},
            )
        drain = time.perf_counter()
        self.publisher.flush()
        self.drain_seconds += time.perf_counter() - drain  # the last batch's linger and store: once per run() call
        self.publisher.check()
        seconds = time.perf_counter() - started
        return RolloutSummary(
            groups=self.stats["groups"],
            published=self.publisher.published,
            publish_failed=self.publisher.failed,
            completions=self.stats["completions"],
            tokens=self.stats["tokens"],
            seconds=round(seconds, 3),
            sample_seconds=round(self.stats["sample_s"], 3),
            score_seconds=round(self.publisher.prepare_seconds, 3),
            waited_seconds=round(self.stats["waited_s"], 3),
            completions_per_second=round(self.stats["completions"] / seconds, 2) if seconds else 0.0,
            adapter_version=self.version,
            versions_used=sorted(self.versions_used),
            batch_size=self.batch_size,
            peer_id=producer,
        )

    def close(self) -> None:
        """Stop everything started, newest first (idempotent)."""
        self._closers.close()

    def __enter__(self) -> RolloutPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_rollout(config: RolloutConfig, on_ready=None, pacing: Pacing | None = None):
    """Start a rollout peer, run it until stopped, close it (:func:`peer.roles.supervisor.supervise`)."""
    return supervise(RolloutPeer(config, pacing), on_ready)


__all__ = [
    "CPU_BATCH_CAP",
    "CUDA_BATCH_CAP",
    "Pacing",
    "RolloutConfig",
    "RolloutSummary",
    "RolloutPeer",
    "auto_batch_size",
    "build_groups",
    "run_rollout",
]
