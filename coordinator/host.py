"""The coordinator (``hivegrpo host``): the swarm's bootstrap peer, which publishes the run and seeds its files.

:class:`Host` joins (or starts) the swarm with a stable identity, serves the base model's files and adapter v0
from its blob cache, publishes the manifest and the v0 announcement, heartbeats as ``coordinator``, and re-stores
both records well before they expire. It is not on the hot path: rollout peers and learners talk to each other.
:meth:`Host.join_command` is the line others paste.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from coordinator.credit_state import CreditState
from coordinator.invites import LEARNER_EXPIRY, InviteBook
from coordinator.manifest import RunSettings, build_manifest, model_folder
from coordinator.web import StatusHistory, WebServer
from peer.closers import Closers
from peer.errors import UserError
from peer.log import get_logger
from peer.network.swarm import NetworkConfig
from peer.protocol import key_fingerprint, manifest_key, owner_subkey, to_dht_value
from peer.run.adapters import announce_adapter
from peer.run.session import default_cache_dir

logger = get_logger(__name__)

MANIFEST_TTL = 3600.0
REFRESH_INTERVAL = 300.0
KNOWN_PEERS = 16  # multiaddrs of other peers the host keeps for its next start
BOOK_POLL = 2.0  # seconds between looks at the invite book


@dataclass(frozen=True)
class HostConfig:
    settings: RunSettings
    network: NetworkConfig = field(default_factory=NetworkConfig)
    cache_dir: Path = field(default_factory=default_cache_dir)
    refresh_interval: float = REFRESH_INTERVAL
    heartbeat_interval: float = 10.0
    status_interval: float = 5.0  # how often the host reads the swarm's status (web page, known peers)
    web_port: int | None = None  # serve the status page here (0: any free port); None: no page
    web_host: str = "127.0.0.1"
    eval_every: float = 0.0  # measure the newest adapter's held-out exact match this often (0: never)
    eval_n: int = 200  # held-out examples per measurement
    max_upload: float | None = None  # bytes/s the host's blob server sends at most (--max-upload); None: no limit
    learners: int = 1  # learn lines printed, each with its own credential (a credential admits one key)


def rejoin_addresses(status: dict, me: str) -> list[str]:
    """What a restarted host rejoins through, from a status reading: the addresses of live admitted learners
    (status lists no other learner) other than ``me``, and only those that name their own peer id — a stranger's
    heartbeat cannot point the host at a swarm of its own. At most ``KNOWN_PEERS``."""
    from peer.status import LIVE

    maddrs = [
        m
        for p in status["peers"]
        if p["role"] == "learner" and p["peer_id"] != me and p["state"] in LIVE
        for m in p["maddrs"]
        if m.endswith(f"/p2p/{p['peer_id']}")
    ]
    return maddrs[:KNOWN_PEERS]


def adapter_v0(folder: Path, settings: RunSettings) -> bytes:
    """Adapter version 0: the LoRA initialisation of the run's config on its base, as bytes."""
    import torch

    from peer.model.adapter import adapter_to_bytes, attach_lora
    from peer.model.config import ModelConfig
    from peer.model.loading import load_base

    with torch.no_grad():
        base = load_base(ModelConfig(name=str(folder), quantization=settings.quantization, device="cpu"))
        return adapter_to_bytes(attach_lora(base.model, settings.lora))


class Host:
    def __init__(self, config: HostConfig):
        self.config = config
        self.swarm = self.blobs = self.heartbeat = self.manifest = None
        self._closers = Closers()
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self.history: StatusHistory | None = None
        self.web: WebServer | None = None
        self._known_saved: list[str] = []
        self.book: InviteBook | None = None  # the invites and learner credentials it issued (with --identity)
        self.invite = None  # the invite printed in the join lines (private runs)
        self.learner_credentials: list = []  # one per learn line printed (peer.network.admission)
        self.credit: CreditState | None = None  # the contributors table it last saw, kept across restarts

    def start(self) -> Host:
        from peer.network.blobs import BlobCache, BlobService
        from peer.network.heartbeat import Heartbeat

        c, s = self.config, self.config.settings
        network = self._private_network() if s.access == "private" else c.network
        folder = model_folder(s.model, s.revision)
        v0 = adapter_v0(folder, s)
        self.swarm = self._join(network)
        self._closers.add(self.swarm.shutdown)
        self.blobs = BlobService(
            self.swarm.dht, BlobCache(c.cache_dir / "blobs"), access=self.swarm.access, max_upload=c.max_upload
        )
        self._closers.add(self.blobs.close)
        if self.book is None and c.network.identity_path is not None:
            self.book = InviteBook(c.network.identity_path, s.run_id)  # a public run's learner credentials
        if self.book is not None:
            if self.swarm.access is not None:
                from peer.network.access import AccessWatcher

                self._access_watcher = AccessWatcher(self.swarm, interval=2.0).start()
                self._closers.add(self._access_watcher.stop)
            self._book_thread = threading.Thread(target=self._watch_book, name="invite-book", daemon=True)
            self._book_thread.start()
        self.learner_credentials = self._learner_credentials()
        self.manifest = build_manifest(s, folder, self.blobs.cache.put_bytes(v0), str(self.swarm.peer_id))
        for f in self.manifest.model.files:
            self.blobs.cache.adopt(folder / f.path, sha256=f.sha256)
        self._v0 = v0
        self.swarm.set_standing(self.swarm.public_key)  # its node's quota keeps room for its records, learners'
        self._publish()
        self.heartbeat = Heartbeat(self.swarm, "coordinator", interval=c.heartbeat_interval)
        self.heartbeat.counters = self.blobs.counters
        self.heartbeat.update(adapter_version=0, state="running")
        self.heartbeat.start()
        self._closers.add(lambda: self.heartbeat.stop(leaving=True))
        self._refresher = threading.Thread(target=self._refresh, name="manifest-refresh", daemon=True)
        self._refresher.start()
        self._closers.add(self._stop_refresher)
        self.credit = CreditState(self.credit_file, s.run_id)
        self.history = StatusHistory(self._read_status, interval=c.status_interval).start()
        self._closers.add(self.history.stop)
        if c.web_port is not None:
            self.web = WebServer(self.history, c.web_host, c.web_port).start()
            self._closers.add(self.web.close)
        if c.eval_every > 0:
            from coordinator.evaluator import HostEvaluator
            from peer.network.admission import Admitted

            admitted = Admitted(self.swarm, self.swarm.public_key, self.manifest.adapter0_sha256)
            admitted.adapter_size = len(self._v0)

            evaluator = HostEvaluator(
                self.swarm,
                self.blobs,
                folder,
                s,
                every=c.eval_every,
                n=c.eval_n,
                on_result=self.history.record_eval,
                admitted=admitted,
            )
            self._closers.add(evaluator.start().stop)
        # the join line of a private run carries its invite: it goes to stdout and the --info-file, never to a log
        logger.info("hosting run %s as coordinator %s at %s", s.run_id, self.fingerprint, self.swarm.visible_maddrs())
        return self

    @property
    def known_peers_file(self) -> Path | None:
        """Beside ``--identity``: a host with a stable identity is the same coordinator when it restarts."""
        identity = self.config.network.identity_path
        return None if identity is None else Path(f"{identity}.{self.config.settings.run_id}.peers.json")

    @property
    def credit_file(self) -> Path:
        """The contributors table the host keeps: beside ``--identity`` (as the known peers), else in the cache
        folder under this coordinator's key fingerprint (a host without an identity is a new coordinator)."""
        run_id, identity = self.config.settings.run_id, self.config.network.identity_path
        if identity is not None:
            return Path(f"{identity}.{run_id}.credit.json")
        return self.config.cache_dir / "host" / f"{run_id}.{self.fingerprint}.credit.json"

    def _private_network(self) -> NetworkConfig:
        """A private run: the invite book beside ``--identity``, and this host's own invite for its DHT."""
        from peer.network.access import issue_invite
        from peer.network.swarm import load_signing_key

        identity, run_id = self.config.network.identity_path, self.config.settings.run_id
        if identity is None:
            raise UserError(
                "a private swarm needs --identity FILE: its invites are signed with the host's key, which must "
                "survive a restart (or every invite given out would stop working)"
            )
        load_signing_key(identity)  # made on first use
        self.book = InviteBook(identity, run_id)
        self.invite = self.book.default_invite()
        own = issue_invite(self.book.issuer, run_id, "coordinator")
        return replace(self.config.network, invite=own.token)

    def _learner_credentials(self) -> list:
        """The learn lines' credentials, one per ``learners`` (``default``, ``learner-2``, …): with ``--identity``
        the invite book's (the same across restarts, and ``hivegrpo invite --role learner`` issues more), else
        ones for this coordinator's lifetime."""
        from peer.network.admission import issue_credential

        names = ["default", *(f"learner-{i + 1}" for i in range(1, self.config.learners))]
        if self.book is None:
            expires = time.time() + LEARNER_EXPIRY
            return [issue_credential(self.swarm.signing_key, self.config.settings.run_id, n, expires) for n in names]
        return [self.book.default_learner(n) for n in names]

    @property
    def learner_credential(self):
        """The first learn line's credential."""
        return self.learner_credentials[0] if self.learner_credentials else None

    def _publish_access(self) -> None:
        from peer.network.access import issuer_public, sign_revocations
        from peer.protocol import AccessRecord, access_key

        revoked, now = self.book.revoked(), time.time()
        record = AccessRecord(
            issuer=issuer_public(self.book.issuer).hex(),
            revoked=revoked,
            created=now,
            signature=sign_revocations(self.book.issuer, self.swarm.run_id, revoked, now).hex(),
        )
        key, subkey = access_key(self.swarm.run_id), owner_subkey(self.swarm.public_key)
        if not self.swarm.store(key, subkey, to_dht_value(record), now + MANIFEST_TTL, "revocation list"):
            logger.warning("no DHT node took the revocation list yet; retrying")
            raise OSError("the revocation list was not stored")

    def _watch_book(self) -> None:
        """Re-read the invite book when ``hivegrpo invite`` changed it; publish what it revoked."""
        seen = self.book.path.stat().st_mtime if self.book.path.exists() else 0.0
        while not self._stop.wait(BOOK_POLL):
            mtime = self.book.path.stat().st_mtime if self.book.path.exists() else 0.0
            if mtime == seen:
                continue
            try:
                self.book.data = self.book._load()
                self._publish_access()
                seen = mtime
                logger.info("published the revocation list: %d invite(s) revoked", len(self.book.revoked()))
            except Exception as e:  # a half-written book or the network: try again next round
                logger.warning("could not publish the invite book's revocations: %s", e)

    def _join(self, network: NetworkConfig):
        """Join from ``--initial-peers``; without them, from the peers this host (same ``--identity``) last saw —
        a restart rejoins the swarm that kept running without it — and alone when none of those answers."""
        from peer.network.swarm import SwarmJoinError, join

        run_id = self.config.settings.run_id
        if network.initial_peers:
            return join(network, run_id)
        known = self._known_peers()
        if known:
            timeout = min(network.bootstrap_timeout, 15.0)
            try:
                swarm = join(replace(network, initial_peers=known, bootstrap_timeout=timeout), run_id)
                logger.info("rejoined the swarm through %d peer(s) seen before", len(known))
                return swarm
            except SwarmJoinError:
                logger.info("none of the %d peers seen before answered: starting the swarm anew", len(known))
        return join(network, run_id)

    def _known_peers(self) -> tuple[str, ...]:
        if self.known_peers_file is None:
            return ()
        try:
            found = json.loads(self.known_peers_file.read_text())
        except (OSError, ValueError):
            return ()
        return tuple(m for m in found if isinstance(m, str))[:KNOWN_PEERS] if isinstance(found, list) else ()

    def _read_status(self) -> dict:
        from peer.status import read_status

        status = self.credit.update(read_status(self.swarm, self.fingerprint))
        maddrs = rejoin_addresses(status, str(self.swarm.peer_id))
        if maddrs:
            self._save_known(maddrs)
        return status

    def _save_known(self, maddrs: list[str]) -> None:
        if maddrs == self._known_saved or self.known_peers_file is None:
            return
        path = self.known_peers_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(maddrs))
        tmp.replace(path)
        self._known_saved = maddrs

    def _publish(self) -> None:
        stored = self.swarm.store(
            manifest_key(self.swarm.run_id),
            owner_subkey(self.swarm.public_key),
            to_dht_value(self.manifest),
            time.time() + MANIFEST_TTL,
            "manifest",
        )
        if not stored:
            raise UserError("no DHT node accepted the run manifest; check --host-maddrs and the network")
        announce_adapter(self.swarm, self.blobs, 0, self._v0, "", ttl=MANIFEST_TTL)
        if self.book is not None:
            self._publish_access()

    def _refresh(self) -> None:
        while not self._stop.wait(self.config.refresh_interval):
            try:
                self._publish()
            except Exception as e:  # the network boundary: try again next round
                logger.warning("could not refresh the manifest: %s", e)

    def _stop_refresher(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=10)

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.swarm.public_key)

    def info(self) -> dict:
        return {
            "run_id": self.swarm.run_id,
            "initial_peers": self.swarm.visible_maddrs(),
            "coordinator": self.fingerprint,
            "invite": None if self.invite is None else self.invite.token,
            "learner_credential": None if self.learner_credential is None else self.learner_credential.token,
            "learner_credentials": [c.token for c in self.learner_credentials],
            "web": None if self.web is None else self.web.url,
            "join_command": self.join_command("join"),
            "learn_command": self.join_command("learn"),
            "learn_commands": [self.join_command("learn", i) for i in range(len(self.learner_credentials))],
            "status_command": self.join_command("status"),
        }

    def join_command(self, role: str = "join", learner: int = 0) -> str:
        """The line a peer of ``role`` pastes: every address, the run, the coordinator's fingerprint, the invite of
        a private run and, for ``learn``, learner ``learner``'s credential: in the environment
        (HIVEGRPO_LEARNER_CREDENTIAL), not in the command's arguments, which every local user can read in
        ``/proc/*/cmdline``."""
        peers = " ".join(f"--initial-peers {m}" for m in self.swarm.visible_maddrs())
        line = f"hivegrpo {role} {peers} --run-id {self.swarm.run_id} --coordinator {self.fingerprint}"
        if self.invite is not None:
            line += f" --invite {self.invite.token}"
        if role == "learn" and self.learner_credentials:
            line = f"HIVEGRPO_LEARNER_CREDENTIAL={self.learner_credentials[learner].token} {line}"
        return line

    def write_info(self, path: Path | str) -> None:
        """The join details as JSON, in a file only this user can read: it holds the invite (a credential)."""
        from peer.files import write_private

        write_private(path, json.dumps(self.info(), indent=2))

    def wait(self) -> None:
        """Serve until :meth:`request_stop`."""
        while not self._stop.wait(1.0):
            pass

    def request_stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._closers.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
