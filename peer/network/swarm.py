"""Joining a swarm: one hivemind DHT per peer, with a persistent identity and the run's record validators.

:func:`join` starts the peer's DHT (hivemind runs it, and its go-libp2p daemon, in child processes), either as the
first peer of a new swarm (no initial peers) or bootstrapped from the multiaddrs someone pasted. It installs the
run's validators (:func:`peer.protocol.validators.make_validators`) so every record this peer stores or serves is
schema-checked and owner-signed, and logs the multiaddrs others can paste.

Home machines: by default the peer listens on all interfaces, uses libp2p relays (``use_relay``) and auto-relay
(``use_auto_relay``) so a peer behind NAT is still reachable through a relay, and may run in *client mode*
(``client_mode``: it queries and stores but serves no DHT requests, for peers nobody can reach). The start-up and
bootstrap timeouts are generous (60 s / 30 s) because home links are slow to open. A peer that cannot bootstrap
raises :class:`SwarmJoinError` naming the addresses it tried and what to check — never a bare traceback or a hang.

Search width: a record lives on the ``REPLICAS`` DHT nodes nearest its key. hivemind searches for them with a beam
of 20 nodes (its bucket size), 4 requests in flight, before every store and on every ``latest`` read: in a swarm of
32 that is ~20 nodes asked over several rounds. The hot paths (bucket entries, stored and polled per batch) pass
``narrow=True``. A narrow store looks the ``replicas`` nearest nodes up (``REPLICAS``; a bucket entry 2, as it also
goes to the learners) with a beam that wide, all asked at once, and then remembers them for the key
(``peer.network.near_store``: later stores to that key skip the lookup). A narrow read asks the key's 2 nearest
nodes at once: every replica gets every store, so one live replica has the whole dictionary and the second covers
one that is down or behind. Both still follow nearer nodes that answers name, so they converge as Kademlia lookups
do; they are less thorough than the wide search when routing tables are stale, which is why bucket readers read
wide now and then (docs/protocol.md "Search width").

Identity: ``identity_path`` keeps the libp2p identity (so the peer id, and thus the multiaddrs others pasted,
survive a restart) and, beside it at ``<identity_path>.rsa``, the RSA key that signs this peer's DHT records (so
a restarted peer still owns its subkeys). Without it, both are fresh for each run of the process. Both files are
created mode 0600 (:func:`peer.files.write_private`): hivemind would write the libp2p one readable by others and
``chmod`` it afterwards, so this module writes it first, in hivemind's format, and hivemind only reads it.
:func:`check_identity_files` reads both as :func:`join` will without starting anything, so the command line refuses
a corrupt one by name before a model loads.

hivemind internals this relies on (written against hivemind 1.1.12)
---------------------------------------------------------------------
hivemind's public API is ``DHT`` (``get``, ``store``, ``run_coroutine``, ``get_visible_maddrs``), ``P2P``, the record
validators and the serializer. The places below go further: into the DHT node that ``DHT.run_coroutine`` hands a
function in the DHT process, into private state, or around a behaviour that is not documented. Any of them can break on
a hivemind upgrade, which is why setup.cfg bounds hivemind to ``>=1.1.12,<1.2``; whoever moves that bound checks each
one (tests/integration/test_swarm.py, test_buckets.py, test_quota_units.py, test_access_units.py, test_private.py and
test_blobs.py exercise them).

* ``peer/network/swarm.py:load_signing_key`` — restores an ``RSAPrivateKey`` with ``__new__`` and
  ``__setstate__({"_private_key": DER bytes})``: its pickled state, a private attribute.
* ``peer/network/swarm.py:create_libp2p_identity`` — writes the identity file as ``P2P.generate_identity`` does:
  a ``hivemind.proto.crypto_pb2.PrivateKey`` (RSA) in the format p2pd reads.
* ``peer/network/swarm.py:Swarm.store_many`` / ``_store_file`` — records are spooled through a file in /dev/shm
  because the pipe from ``DHT`` to its process is read non-blocking: under load the reader finds half of a
  message over 16 KiB and the DHT process dies. ``_store_file`` runs in that process and calls
  ``DHTNode.store_many(..., await_all_replicas=...)``.
* ``peer/network/swarm.py:_local_entries`` / ``_Stores`` — reads ``node.protocol.storage`` (``DHTLocalStorage``,
  keyed by ``DHTID.generate(source=key)``, dictionaries as ``DictionaryDHTValue``), ``node.protocol.serializer`` and
  ``node.protocol.record_validator.strip_value(DHTRecord(...))``; wraps ``storage.store_subkey`` as the quota does
  (every store into the node's storage, local or remote, goes through it).
* ``peer/network/swarm.py:Swarm.__init__`` — slices the bare key out of ``RSASignatureValidator.local_public_key``,
  which is ``b"[owner:" + key + b"]"`` (its ``PUBLIC_KEY_FORMAT``; ``peer/protocol/keys.py`` ``OWNER_PREFIX`` and
  the subkey patterns mirror it).
* ``peer/network/swarm.py:Swarm.get_dict`` — ``DHT.get(latest=True, beam_size=..., num_workers=...)``: keyword
  arguments ``DHT.get`` passes on to ``DHTNode.get_many`` unchecked.
* ``peer/network/swarm.py:join`` — ``check_if_identity_free=False``, passed through ``DHT`` to ``P2P.create``.
* ``peer/network/near_store.py:store_near`` (``_store_key``, ``_nearest_nodes``, ``_signed``) — redoes the store
  round of ``DHTNode.store_many``: ``DHTNode.find_nearest_nodes``, ``node.protocol.call_store``,
  ``node.protocol.storage.store``, ``node.protocol.record_validator`` (``validate``, ``sign_value``),
  ``node.protocol.serializer``, ``node.node_id``.
* ``peer/network/quota.py:install`` / ``quota_stats`` — replaces ``node.protocol.storage.store_subkey`` with a
  wrapper that reads ``storage.get(key)`` (``DictionaryDHTValue`` items) and ``get_dht_time()``, and keeps its
  counts in ``storage._hivegrpo_quota``.
* ``peer/network/access.py:_authorizer_class`` / ``_apply_in_dht`` — subclasses ``TokenAuthorizerBase`` (with
  ``hivemind.proto.auth_pb2.AccessToken``) and updates the DHT process's copy of it, ``node.protocol.authorizer``.
* ``peer/network/blobs/service.py:_daemon_listen_maddr`` — ``node.p2p.daemon_listen_maddr``, for a private
  ``P2P.replicate`` of the DHT's daemon instead of the shared ``DHT.replicate_p2p()``.
* ``peer/protocol/validators.py:_ShapedSubkey`` / ``_RunSchemaConfig`` — extends ``BytesWithPublicKey``'s pydantic
  v1 validator chain (``__get_validators__``), and gives the schema its own ``Config`` because
  ``SchemaValidator._patch_schema`` sets ``schema.Config.extra``.
* ``peer/protocol/limits.py:check_value_size`` — ``MAX_DHT_VALUE_BYTES`` is below what that same pipe carries
  (a value over ~64 KB kills the DHT process instead of failing the store).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from peer.errors import UserError
from peer.files import write_private
from peer.log import get_logger
from peer.network.quota import install as install_quota
from peer.protocol import check_run_id, check_value_size

logger = get_logger(__name__)

REPLICAS = 5  # hivemind's num_replicas, set explicitly: a narrow store writes to this many nearest nodes
NARROW_READ = {"beam_size": 2, "num_workers": 2}  # a narrow read asks the 2 nearest nodes, both at once


class SwarmJoinError(UserError, RuntimeError):
    """The peer could not start or bootstrap its DHT; the message names the addresses tried and what to check."""


class IdentityFileError(SwarmJoinError):
    """An identity file (``identity_path`` or its ``.rsa`` signing key) that cannot be read or holds no key."""


@dataclass(frozen=True)
class NetworkConfig:
    initial_peers: tuple[str, ...] = field(
        default=(), metadata={"help": "multiaddrs of peers already in the swarm, as the host prints them"}
    )
    host_maddrs: tuple[str, ...] = field(
        default=("/ip4/0.0.0.0/tcp/0",),
        metadata={"help": "where to listen, e.g. /ip4/0.0.0.0/tcp/31337 (default /ip4/0.0.0.0/tcp/0: any free port)"},
    )
    announce_maddrs: tuple[str, ...] = field(
        default=(), metadata={"help": "public multiaddrs to announce (a port forwarded on the home router)"}
    )
    identity_path: str | None = field(default=None, metadata={"help": "file keeping this peer's identity"})
    use_relay: bool = field(default=True, metadata={"help": "reach and be reached through libp2p relays"})
    use_auto_relay: bool = field(default=True, metadata={"help": "find a relay automatically when behind NAT"})
    client_mode: bool = field(
        default=False, metadata={"help": "query the DHT without serving it (for peers nobody can reach)"}
    )
    startup_timeout: float = field(default=60.0, metadata={"help": "seconds to wait for the libp2p daemon"})
    bootstrap_timeout: float = field(default=30.0, metadata={"help": "seconds to wait for the initial peers"})
    invite: str | None = field(default=None, metadata={"help": "a private swarm's invite, as its host gave it"})

    def __post_init__(self):
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.startup_timeout <= 0 or self.bootstrap_timeout <= 0:
            raise ValueError("startup_timeout and bootstrap_timeout must be positive seconds")

    @classmethod
    def loopback(cls, initial_peers=(), **overrides) -> NetworkConfig:
        """A closed configuration for tests and the local demo: 127.0.0.1 only, no relays."""
        base = dict(host_maddrs=("/ip4/127.0.0.1/tcp/0",), use_relay=False, use_auto_relay=False)
        return cls(initial_peers=tuple(initial_peers), **{**base, **overrides})


def load_signing_key(identity_path: str | None):
    """The RSA key that signs this peer's records: kept at ``<identity_path>.rsa`` when a path is given."""
    from hivemind.utils.crypto import RSAPrivateKey

    if identity_path is None:
        return RSAPrivateKey()
    path = Path(f"{identity_path}.rsa")
    if path.exists():
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": _signing_key_bytes(path)})  # hivemind's own (DER) key serialization
        return key
    key = RSAPrivateKey()
    write_private(path, key.to_bytes())
    return key


def _signing_key_bytes(path: Path) -> bytes:
    """The signing key file's bytes, once they read as a DER private key (as hivemind's ``RSAPrivateKey`` reads
    them: with cryptography, which needs no hivemind import)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_der_private_key

    data = _read_identity_file(path, "signing key")
    try:
        load_der_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise IdentityFileError(
            f"{path} is a corrupt signing key file (not a DER private key): move it away to make a new key (this "
            "peer's records are then signed by a new owner, and a host must issue its invites again)"
        ) from e
    return data


def _read_identity_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise IdentityFileError(
            f"cannot read the {what} file {path} ({e.strerror}): make it readable, or pass another --identity"
        ) from e


def check_identity_files(identity_path: str) -> None:
    """Read the identity at ``identity_path`` and its ``.rsa`` signing key as :func:`join` will, starting nothing;
    raises :class:`IdentityFileError` naming a file that is unreadable or holds no key. Files not there yet pass:
    :func:`join` makes them."""
    path = Path(identity_path)
    if path.exists():
        from cryptography.exceptions import UnsupportedAlgorithm
        from google.protobuf.message import DecodeError
        from hivemind.p2p import PeerID

        try:
            PeerID.from_identity(_read_identity_file(path, "identity"))  # what hivemind reads it with
        except (DecodeError, ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise IdentityFileError(
                f"{path} is a corrupt identity file (not a libp2p private key): move it away to make a new "
                "identity (the peer id, and so the multiaddrs others pasted, then change)"
            ) from e
    if Path(f"{identity_path}.rsa").exists():
        _signing_key_bytes(Path(f"{identity_path}.rsa"))


def create_libp2p_identity(identity_path: str) -> bool:
    """Write a new libp2p identity (as hivemind's ``P2P.generate_identity`` does, but created 0600) unless one is
    there; whether it wrote one."""
    if Path(identity_path).exists():
        return False
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    write_private(identity_path, key.SerializeToString())
    return True


async def _store_file(
    path: str, all_replicas: bool, narrow: bool, also: tuple, replicas: int, _dht, node
) -> list[bool]:
    """Runs inside the DHT process: store every record of the msgpack file at ``path`` (then delete it)."""
    items = _spooled_items(path)
    if narrow:
        from peer.network.near_store import store_near

        return await store_near(node, items, replicas, all_replicas, also)
    keys = [key for key, _, _, _ in items]
    subkeys = [subkey for _, subkey, _, _ in items]
    found = await node.store_many(
        keys,
        [value for _, _, value, _ in items],
        [expiration for _, _, _, expiration in items],
        subkeys=subkeys,
        await_all_replicas=all_replicas,
    )
    return [bool(found.get((key, subkey))) for key, subkey in zip(keys, subkeys, strict=True)]


async def _push_file(path: str, peers: tuple, _dht, node) -> int:
    """Runs inside the DHT process: send every record of the msgpack file at ``path`` (then delete it) to ``peers``."""
    from peer.network.near_store import push

    return await push(node, _spooled_items(path), peers)


async def _deliver_file(path: str, peers: tuple, _dht, node) -> list[bool]:
    """Runs inside the DHT process: :func:`~peer.network.near_store.deliver` the records of the msgpack file at
    ``path`` (then delete it) to ``peers``."""
    from peer.network.near_store import deliver

    return await deliver(node, _spooled_items(path), peers)


def _spooled_items(path: str) -> list:
    """The records of a spool file :meth:`Swarm._spooled` wrote (this peer's own, in its private folder); the file
    is deleted."""
    from hivemind.utils.serializer import MSGPackSerializer

    file = Path(path)
    try:
        return MSGPackSerializer.loads(file.read_bytes())
    finally:
        file.unlink(missing_ok=True)


def subkey_tag(subkey) -> int:
    """A short tag of a DHT subkey (64 bits of its blake2b): what a reader passes to :meth:`Swarm.local_dict` to
    skip the entries it has read already."""
    import hashlib

    data = subkey if isinstance(subkey, bytes) else repr(subkey).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


async def _get_latest(key: str, search: dict, _dht, node):
    """Runs inside the DHT process: ``DHT.get(key, latest=True, **search)``, as hivemind's own ``DHT._get`` runs it."""
    return await node.get(key, latest=True, **search)


class _Stores:
    """Runs inside the DHT process: numbers the stores into this node's storage and wakes whoever waits for one
    (:func:`_wait_local`). Installed on the first wait, around whatever ``storage.store_subkey`` is then (the
    quota's wrapper: what it refuses is not a store)."""

    MAX_KEYS = 4096  # keys whose latest store is remembered (a run's keys are fewer; the rest were refused)

    def __init__(self, storage):
        self.count = 0  # stores so far
        self.latest: dict = {}  # key DHTID -> self.count at its latest store (oldest first)
        self.event = asyncio.Event()  # set, and replaced, by every store
        original = storage.store_subkey

        def store_subkey(key, subkey, value, expiration_time) -> bool:
            stored = original(key, subkey, value, expiration_time)
            if stored:
                self.stored(key)
            return stored

        storage.store_subkey = store_subkey

    def stored(self, key) -> None:
        self.count += 1
        self.latest.pop(key, None)
        self.latest[key] = self.count
        while len(self.latest) > self.MAX_KEYS:
            self.latest.pop(next(iter(self.latest)))
        event, self.event = self.event, asyncio.Event()
        event.set()

    @classmethod
    def of(cls, node) -> _Stores:
        storage = node.protocol.storage
        stores = getattr(storage, "_hivegrpo_stores", None)
        if stores is None:
            stores = storage._hivegrpo_stores = cls(storage)
        return stores


async def _wait_local(skips: dict, since: int, timeout: float, _dht, node) -> tuple[int, dict]:
    """Runs inside the DHT process: once a key of ``skips`` was stored into after store number ``since`` (-1: at
    once), or ``timeout`` s passed, ``(the number of the latest store, {key: _local_entries(key, skip)})``."""
    from hivemind.dht.routing import DHTID

    stores = _Stores.of(node)
    ids = {key: DHTID.generate(source=key) for key in skips}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while since >= 0 and max((stores.latest.get(i, 0) for i in ids.values()), default=0) <= since:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(stores.event.wait(), left)
        except TimeoutError:
            break
    return stores.count, {key: _local_entries(node, ids[key], skip) for key, skip in skips.items()}


def _local_entries(node, key_id, skip: frozenset) -> dict:
    """The dictionary under ``key_id`` in this node's storage, signatures stripped and values decoded as
    ``DHT.get`` returns them, but for the subkeys whose :func:`subkey_tag` is in ``skip``."""
    from hivemind.dht.crypto import DHTRecord
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.timed_storage import ValueWithExpiration

    found = node.protocol.storage.get(key_id)
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return {}
    serializer, validator, out = node.protocol.serializer, node.protocol.record_validator, {}
    for subkey, (value, expiration) in found.value.items():
        if skip and subkey_tag(subkey) in skip:
            continue
        if validator is not None:
            value = validator.strip_value(DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value, expiration))
        out[subkey] = ValueWithExpiration(serializer.loads(value), expiration)
    return out


async def _settle_dht_process(_dht, node) -> int:
    """Runs inside the DHT process once it has started: move what it inherited and loaded (~0.5M objects: the
    forked peer's modules) out of the garbage collector's sight. A full collection over them held the process's
    event loop for ~0.3 s, and every store and read waiting on it; afterwards full collections walk only what the
    process made since (docs/protocol.md). Returns how many objects were frozen."""
    import gc

    from peer.procname import name_process

    name_process("hivegrpo-dht")

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Swarm:
    """This peer's membership of one run's swarm: its DHT, signing identity, and size-checked store/get."""

    def __init__(self, dht, run_id: str, signing_key, config: NetworkConfig, access=None):
        from hivemind.dht.crypto import RSASignatureValidator

        self.dht = dht
        self.access = access  # a private swarm's peer.network.access.Access; None in a public one
        self.run_id = run_id
        self.signing_key = signing_key
        self.config = config
        self.public_key: bytes = RSASignatureValidator(signing_key).local_public_key[len(b"[owner:") : -1]
        self.peer_id = dht.peer_id
        shm = Path("/dev/shm")
        self._spool = Path(tempfile.mkdtemp(prefix="hivegrpo-dht-", dir=shm if shm.is_dir() else None))
        self._counter = itertools.count()
        self._calls = None  # peer.network.calls.Channel once open_calls ran; until then hivemind's pipe

    def open_calls(self) -> None:
        """Start the DHT process's side channel (:mod:`peer.network.calls`) in this swarm's private folder: the
        frequent calls (stores, pushes, reads) go through it from now on."""
        from peer.network.calls import Channel, serve

        path = str(self._spool / "calls.sock")
        self.dht.run_coroutine(partial(serve, path))
        self._calls = Channel(path)

    def call(self, function):
        """``function(dht, node)`` run in the DHT process, as ``DHT.run_coroutine`` runs it (over the side channel
        once open)."""
        if self._calls is not None:
            return self._calls.call(function)
        return self.dht.run_coroutine(function)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def store(
        self,
        key: str,
        subkey: bytes,
        value: Any,
        expiration_time: float,
        what: str,
        *,
        all_replicas: bool = True,
    ) -> bool:
        """Store one record after checking its size against the DHT limit (before hivemind ever sees it).

        ``all_replicas=False`` returns at the first replica that took it; the others are written in the background.
        """
        return self.store_many([(key, subkey, value, expiration_time)], what, all_replicas=all_replicas)[0]

    def store_many(
        self,
        items: list[tuple[str, bytes, Any, float]],
        what: str,
        *,
        all_replicas: bool = True,
        narrow: bool = False,
        also: tuple[str, ...] = (),
        replicas: int = REPLICAS,
    ) -> list[bool]:
        """Store several ``(key, subkey, value, expiration_time)`` records, each size-checked first, concurrently;
        ``narrow``: store on the ``replicas`` remembered nearest nodes, found with a narrow lookup (module
        docstring); with it, ``also`` names peers (base58 ids) that get the records too, in the background (a
        learner's own copy).

        The records never travel through the pipe to the DHT process: hivemind reads that pipe non-blocking, and
        a message over 16 KiB is written in two parts, so under load the reader can find half a message and the
        DHT process dies (``BlockingIOError`` then ``EOFError``). They go through a file in a private folder
        instead, and the pipe carries only a small message naming it (docs/protocol.md).
        """
        with self._spooled(items, what) as path:
            return self.call(partial(_store_file, path, all_replicas, narrow, tuple(also), replicas))

    @contextmanager
    def _spooled(self, items: list[tuple[str, bytes, Any, float]], what: str):
        """A file holding ``items`` (each value size-checked) for the DHT process to read; removed after."""
        from hivemind.utils.serializer import MSGPackSerializer

        for _, _, value, _ in items:
            check_value_size(MSGPackSerializer.dumps(value), what)
        path = self._spool / f"{os.getpid()}-{threading.get_ident()}-{next(self._counter)}.msgpack"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(MSGPackSerializer.dumps([list(item) for item in items]))
        tmp.replace(path)
        try:
            yield str(path)
        finally:
            path.unlink(missing_ok=True)

    def push(self, items: list[tuple[str, bytes, Any, float]], peers: Sequence[str], what: str) -> int:
        """Send ``(key, subkey, value, expiration_time)`` records (size-checked, signed) to the DHT nodes of ``peers``
        (base58 ids) without waiting for them: a copy for peers that read their own node (:meth:`local_dict`), beside
        the usual store of the records. Returns how many peers they were sent to."""
        if not peers:
            return 0
        with self._spooled(items, what) as path:
            return self.call(partial(_push_file, path, tuple(peers)))

    def deliver(self, items: list[tuple[str, bytes, Any, float]], peers: Sequence[str], what: str) -> list[bool]:
        """Like :meth:`push`, but wait (at most ``near_store.DELIVER_WAIT`` s) for the peers' nodes to answer: per
        record, whether one of them took it."""
        if not peers:
            return [False] * len(items)
        with self._spooled(items, what) as path:
            return self.call(partial(_deliver_file, path, tuple(peers)))

    def get_dict(self, key: str, *, narrow: bool = False) -> dict:
        """The ``{subkey: ValueWithExpiration}`` dictionary under ``key`` (empty if none), merged from every node the
        search asks; ``narrow``: only the key's 2 nearest nodes (module docstring)."""
        found = self.call(partial(_get_latest, key, NARROW_READ if narrow else {}))
        if found is None or not isinstance(found.value, dict):
            return {}
        return found.value

    def set_standing(self, coordinator_key: bytes, admitted=frozenset()) -> None:
        """Tell this peer's DHT node whose records may evict strangers' in the run's small keys: the coordinator the
        manifest names, and the learners this peer admitted (:mod:`peer.network.quota`, "standing"). Not waited
        for: it is one call to the DHT process."""
        from peer.network.quota import set_standing

        self.dht.run_coroutine(partial(set_standing, coordinator_key, frozenset(admitted)), return_future=True)

    def local_dict(self, key: str, skip: Collection[int] = ()) -> dict:
        """Like :meth:`get_dict`, from this peer's own DHT node only (what it holds as a replica or was sent with
        ``also``): no request leaves the process pair. ``skip``: :func:`subkey_tag` of entries left out (a reader's
        own, already read: neither decoded in the DHT process nor sent through the pipe again)."""
        return self.wait_local({key: skip})[1][key]

    def wait_local(
        self, skips: Mapping[str, Collection[int]], since: int = -1, timeout: float = 0.0
    ) -> tuple[int, dict[str, dict]]:
        """:meth:`local_dict` of every key of ``skips`` (each without the entries its tags name), in one call to the
        DHT process, which answers once this node stored into one of the keys after its store number ``since``, or
        after ``timeout`` s (``since`` -1: at once). Returns ``(the number of its latest store, {key: dict})``: pass
        the number as the next ``since`` to wait for what comes after (a reader that waits instead of polling)."""
        keys = {key: frozenset(skip) for key, skip in skips.items()}
        return self.call(partial(_wait_local, keys, since, timeout))

    def shutdown(self) -> None:
        self.dht.shutdown()
        shutil.rmtree(self._spool, ignore_errors=True)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def join(config: NetworkConfig, run_id: str) -> Swarm:
    """Start this peer's DHT and join the swarm of ``run_id``; raises :class:`SwarmJoinError` on failure."""
    import hivemind

    from peer.protocol.validators import make_validators

    check_run_id(run_id)
    if config.identity_path:
        check_identity_files(config.identity_path)
    signing_key = load_signing_key(config.identity_path)
    access = None
    if config.invite:
        from peer.network.access import Access, parse_invite

        access = Access(parse_invite(config.invite), run_id)  # InviteError (a UserError) before any networking
    kwargs = dict(
        host_maddrs=list(config.host_maddrs),
        use_relay=config.use_relay,
        use_auto_relay=config.use_auto_relay,
        client_mode=config.client_mode,
        startup_timeout=config.startup_timeout,
        bootstrap_timeout=config.bootstrap_timeout,
    )
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    if access is not None:
        kwargs["authorizer"] = access.authorizer(signing_key)
    if config.identity_path:
        if create_libp2p_identity(config.identity_path):
            kwargs["check_if_identity_free"] = False  # a new key: nobody else has it (hivemind's own reasoning)
        kwargs["identity_path"] = config.identity_path
    start = time.perf_counter()
    try:
        dht = hivemind.DHT(
            initial_peers=list(config.initial_peers) or None,
            start=True,
            num_replicas=REPLICAS,
            record_validators=make_validators(run_id, signing_key),
            **kwargs,
        )
    except Exception as e:
        raise SwarmJoinError(_join_failure(config, e)) from e
    dht.run_coroutine(_settle_dht_process)
    dht.run_coroutine(partial(install_quota, run_id))  # what this node keeps of the run's keys is bounded
    swarm = Swarm(dht, run_id, signing_key, config, access)
    swarm.open_calls()
    logger.info(
        "joined run %s as %s in %.1fs; others can join with --initial-peers %s",
        run_id,
        swarm.peer_id,
        time.perf_counter() - start,
        " ".join(swarm.visible_maddrs()),
    )
    return swarm


def _join_failure(config: NetworkConfig, error: Exception) -> str:
    if not config.initial_peers:
        return (
            f"could not start the local DHT ({type(error).__name__}: {error}); check that --host-maddrs "
            f"{' '.join(config.host_maddrs)} can be bound and that nothing else holds the identity file"
        )
    if config.invite:
        private = (
            "; the swarm is private and its peers answer only valid invites: if they are reachable, this invite "
            "may have been revoked (ask the host for a new one)"
        )
    else:
        private = (
            "; if the swarm is private, its peers answer nobody without an invite: pass --invite TOKEN from its host"
        )
    return (
        f"could not join the swarm through any of {', '.join(config.initial_peers)} "
        f"({type(error).__name__}: {error}); check that these multiaddrs are current (the host prints them at start), "
        "that the host is running, and that this machine can reach its address and port (a firewall, or a home "
        f"router without port forwarding on the host's side){private}"
    )
