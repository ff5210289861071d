"""What every model-holding peer of a run does first, and the adapter swap they share.

A rollout peer and a learner start alike: join the swarm, start a blob service and a heartbeat, read the manifest,
get the base model files (:mod:`peer.run.basemodel`), load the base quantized as the manifest says, attach LoRA
and take the newest adapter announced (or rebuild v0 and check it against the manifest). :func:`open_session`
does all of that and returns a :class:`Session`; everything it started is registered with the caller's
:class:`~peer.closers.Closers`, so a failure half-way leaves nothing running.

:meth:`Session.swap` loads an adapter blob in place and then hashes the adapter the model *actually holds*: a
mismatch is an error, never a warning, because every group or update made afterwards would carry a false version.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path

from peer.closers import Closers
from peer.errors import UserError
from peer.log import get_logger
from peer.model.adapter import (
    AdapterError,
    adapter_to_bytes,
    attach_lora,
    load_adapter_bytes,
    parse_adapter,
    sha256_hex,
)
from peer.model.config import ModelConfig
from peer.model.loading import load_base
from peer.network.blobs.fetch import DEFAULT_TIMEOUT
from peer.network.swarm import NetworkConfig
from peer.protocol import key_fingerprint, peer_name_problem
from peer.run.adapters import announcements, fetch_adapter, fetch_version, newest_announcement
from peer.run.spec import RunSpec, read_manifest, run_spec

logger = get_logger(__name__)


def default_cache_dir() -> Path:
    return Path("~/.cache/hivegrpo").expanduser()


@dataclass(frozen=True)
class SessionConfig:
    """The start-up settings a rollout peer and a learner share."""

    run_id: str
    network: NetworkConfig = field(default_factory=NetworkConfig)
    coordinator: str | None = None  # fingerprint of the host's key; None: the only manifest there is
    quantization: str | None = None  # None: as the manifest says
    device: str = "auto"
    dtype: str = "auto"  # compute dtype (a peer's own choice: verification tolerates any of the three)
    cache_dir: Path = field(default_factory=default_cache_dir)
    heartbeat_interval: float = 10.0
    allowed_tasks: tuple[str, ...] = ()  # plug-in task modules a manifest may name (--allow-task); none by default
    learner_credential: str | None = None  # a learner's credential from the host (hgl1.…); learners must have one
    name: str | None = None  # the peer's --name, in its heartbeat (status, the credit table)
    max_upload: float | None = None  # bytes/s this peer's blob server sends at most (--max-upload); None: no limit
    max_memory: int | None = None  # a rollout peer's --max-memory: bounds the base's unpacking (load_base)

    def __post_init__(self):
        if self.name is not None and (problem := peer_name_problem(self.name)) is not None:
            raise ValueError(f"name {self.name!r}: {problem}")

    @classmethod
    def of(cls, role_config) -> SessionConfig:
        """The start-up settings of a role's config: each of this class's fields the role's config has, by name."""
        names = [f.name for f in fields(cls)]
        return cls(**{name: getattr(role_config, name) for name in names if hasattr(role_config, name)})


@dataclass
class Session:
    """A started peer of a run holding the base model with an adapter: ``version``/``sha`` is what it holds."""

    swarm: object
    blobs: object
    heartbeat: object
    spec: RunSpec
    model: object
    tokenizer: object
    device: object
    version: int = -1
    sha: str = ""
    parent: str = ""  # the sha256 of the held adapter's parent, as announced ("" for v0)
    blob: bytes = b""  # the held adapter's bytes (hash == sha)
    admitted: object = None  # the run's admitted learners (peer.network.admission.Admitted)
    revoked: str | None = None  # why this peer must stop: the host revoked its invite (private swarms)
    on_revoked: list = field(default_factory=list)  # what to call then (the role's request_stop)
    swap_seconds: list[float] = field(default_factory=list)
    merged: object = None  # a sampler's LoRA held in its base weights (peer.model.merge.MergedLoRA): swaps refresh it

    def revoke(self, message: str) -> None:
        self.revoked = message
        for stop in self.on_revoked:
            stop()

    def providers(self):
        """Peers to ask for blobs, in order: the coordinator the manifest names (it seeds the model), the admitted
        learners (they keep adapters), then other live peers (``blob_providers``: no heartbeat comes first)."""
        from peer.network.heartbeat import blob_providers

        learners = sorted(self.admitted.peer_ids()) if self.admitted is not None else []
        random.shuffle(learners)
        return blob_providers(self.swarm, trusted=[self.spec.manifest.coordinator, *learners])

    def swap(self, version: int, sha: str, blob: bytes, *, quiet: bool = False) -> None:
        """Load adapter ``version`` in place; AdapterError unless the model then holds exactly ``sha``.

        ``quiet``: a short visit (a learner's spot check under an older version) — the heartbeat is left alone.
        """
        start = time.perf_counter()
        load_adapter_bytes(self.model, blob, sha)
        if self.merged is not None:
            self.merged.refresh()
        held = sha256_hex(adapter_to_bytes(self.model))
        if held != sha:
            raise AdapterError(
                f"after loading adapter v{version} the model's adapter hashes to {held[:12]}…, not the announced "
                f"{sha[:12]}…: what this peer makes would carry a false version, so it stops; report it with the log"
            )
        self.version, self.sha, self.blob = version, sha, blob
        self.swap_seconds.append(time.perf_counter() - start)
        if not quiet:
            self.heartbeat.update(adapter_version=version)

    def check_adapter(self, blob: bytes) -> str | None:
        """None if this model can load ``blob``, else why not (it changes nothing; a follower's pre-check)."""
        try:
            parse_adapter(self.model, blob)
        except AdapterError as e:
            return str(e)
        return None

    def fetch_adapter(self, sha: str, size: int, providers) -> bytes:
        """An adapter's bytes from ``providers`` (base58 peer ids), else from any live peer of the run."""
        return fetch_adapter(self.blobs, sha, size, providers, self.providers, DEFAULT_TIMEOUT)

    def fetch_version(self, found) -> bytes:
        """An announced version's bytes, from the peers that hold it first (see :func:`fetch_version`)."""
        return fetch_version(self.swarm, self.blobs, found, self.providers, DEFAULT_TIMEOUT)[0]


# The main thread gives the GIL up around every torch kernel; a background thread (a publisher, the adapter
# follower, hivemind's future and fd-sharing threads) that takes it then keeps it until the switch interval
# ends: 5 ms by default, against kernels of tens of microseconds. At 0.5 ms the main thread waits a tenth as long
# (measured in docs/rollout.md).
SWITCH_INTERVAL = 0.0005  # s


def settle_process() -> None:
    """Once a peer has started: keep background threads from holding its main thread up.

    Everything loaded so far (modules, the model, the swarm's objects: ~500k objects the collector tracks) lives as
    long as the peer; frozen out of the collector's sight, a full collection takes milliseconds instead of the
    0.25-0.6 s it took — holding the GIL, on whichever thread triggered it. And the switch interval is shortened.
    """
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL)


def open_session(config: SessionConfig, role: str, closers: Closers) -> Session:
    """Join, read the manifest, load the base with LoRA and the newest adapter; see the module docstring."""
    from peer.network.admission import Admitted, CredentialError, parse_credential
    from peer.network.blobs import BlobCache, BlobService
    from peer.network.heartbeat import Heartbeat
    from peer.network.swarm import join
    from peer.run.basemodel import fetch_from, resolve_base

    c = config
    credential = None
    if role == "learner":
        if not c.learner_credential:
            raise CredentialError(
                "a learner needs --learner-credential: only learners the run's host admitted may write its adapter "
                "versions; copy the learn line `hivegrpo host` printed (it carries one), or ask the host for one"
            )
        credential = parse_credential(c.learner_credential)
    swarm = join(c.network, c.run_id)
    closers.add(swarm.shutdown)
    blobs = BlobService(swarm.dht, BlobCache(c.cache_dir / "blobs"), access=swarm.access, max_upload=c.max_upload)
    closers.add(blobs.close)
    heartbeat = Heartbeat(swarm, role, interval=c.heartbeat_interval, name=c.name)
    heartbeat.counters = blobs.counters
    heartbeat.start()
    closers.add(lambda: heartbeat.stop(leaving=True))
    revoked: list[str] = []
    if swarm.access is not None:
        from peer.network.access import AccessWatcher

        watcher = AccessWatcher(swarm, on_revoked=revoked.append).start()
        closers.add(watcher.stop)

    manifest, coordinator_key = read_manifest(swarm, c.coordinator)
    spec = run_spec(manifest, coordinator_key, allowed_modules=frozenset(c.allowed_tasks))
    logger.info(
        "run %s: %s on %s (%s), G=%d, coordinator %s",
        spec.run_id,
        spec.task.name,
        manifest.model.name,
        manifest.model.quantization,
        spec.sampling.group_size,
        key_fingerprint(coordinator_key),
    )
    session = Session(swarm, blobs, heartbeat, spec, None, None, None)
    session.admitted = Admitted(swarm, coordinator_key, manifest.adapter0_sha256)
    swarm.set_standing(coordinator_key)  # this node's quota: the coordinator's and admitted learners' records first
    session.admitted.on_change = partial(swarm.set_standing, coordinator_key)
    if credential is not None:
        _admit_self(session, credential)
    if swarm.access is not None:
        watcher.on_revoked = session.revoke
        if revoked:
            session.revoke(revoked[0])
    folder = resolve_base(manifest.model, blobs.cache, c.cache_dir / "models", fetch_from(blobs, session.providers))
    quantization = c.quantization or manifest.model.quantization
    if quantization != manifest.model.quantization:
        logger.warning(
            "loading a %s base while the run uses %s: the log-probs differ from the other peers', so groups are "
            "more off-policy (and a learner's spot checks may refuse honest ones)",
            quantization,
            manifest.model.quantization,
        )
    model_config = ModelConfig(name=str(folder), quantization=quantization, device=c.device, dtype=c.dtype)
    base = load_base(model_config, max_memory=c.max_memory)
    session.model, session.tokenizer, session.device = attach_lora(base.model, spec.lora), base.tokenizer, base.device
    _load_newest_adapter(session)
    return session


def _admit_self(session: Session, credential) -> None:
    """A learner: check its credential against this run's coordinator, publish its admission, keep it stored."""
    from peer.network.admission import CredentialError, keep_admitted, verify_certificate

    try:
        certificate = verify_certificate(credential.certificate.raw, session.spec.coordinator_key, session.spec.run_id)
    except CredentialError as e:
        raise CredentialError(
            f"{e}: this learner's --learner-credential does not admit it to run {session.spec.run_id!r}; use the "
            "credential in the learn line that run's `hivegrpo host` printed, or ask its host for one "
            "(`hivegrpo invite --role learner`)"
        ) from None
    if not keep_admitted(session.swarm, session.heartbeat, credential):
        raise UserError("no DHT node accepted this learner's admission record; check this peer's connection")
    session.admitted.learners(force=True)
    logger.info("admitted as a learner of the run (credential %s)", certificate.credential_id)


def _load_newest_adapter(session: Session) -> None:
    """The newest announced adapter that some peer still serves (a version whose announcers died before anyone
    fetched it is skipped, with a warning); v0, rebuilt here, when none is announced."""
    from peer.network.blobs import BlobUnavailable

    manifest = session.spec.manifest
    v0 = adapter_to_bytes(session.model)
    session.admitted.adapter_size = len(v0)  # every version has v0's size: nothing larger is ever fetched
    records = announcements(session.swarm, session.admitted)
    while (found := newest_announcement(records)) is not None and found.version > 0:
        try:
            blob = session.fetch_version(found)
            session.swap(found.version, found.sha256, blob)
        except (BlobUnavailable, AdapterError) as e:
            logger.warning("announced adapter v%d is unusable (%s); trying an older one", found.version, e)
            records = [(k, r) for k, r in records if r.version < found.version]
            continue
        session.parent = found.parent_sha256
        return
    if found is None or (found.version == 0 and found.sha256 == sha256_hex(v0)):
        if sha256_hex(v0) != manifest.adapter0_sha256:
            raise AdapterError(
                f"adapter v0 built here hashes to {sha256_hex(v0)[:12]}…, the manifest says "
                f"{manifest.adapter0_sha256[:12]}… and no peer announces an adapter: this hivegrpo (or torch) "
                "version initialises LoRA differently from the host's; install the host's versions"
            )
        session.swap(0, manifest.adapter0_sha256, v0)  # (again: a refused blob may have been loaded half-way)
        return
    session.swap(found.version, found.sha256, session.fetch_version(found))


__all__ = ["Session", "SessionConfig", "default_cache_dir", "open_session"]
