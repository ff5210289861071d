"""Stores that skip the lookup when this DHT node already knows a key's nearest nodes (runs in the DHT process).

hivemind's ``store_many`` looks up a key's nearest nodes before every store: one round of requests, then the store
round. A rollout peer stores into the same bucket keys (a ring of 64, one per adapter version) many times, so
:func:`store_near` remembers the nearest nodes a lookup found, for ``REMEMBER`` seconds per key (``REMEMBER_FEW`` when
it found fewer than the replicas asked for), and stores straight to them: one round instead of two. Before each such
store it asks this node's routing table (no request) whether it knows a node nearer to the key than one of the
remembered ones, or, for a set not full, any other node: a node that joined near the key and that this node has
heard of (every request it sends or answers does that) makes it look the key up again. A replica that does not
answer forgets the key's nodes too (the next store looks them up again); a store no replica took falls back to
hivemind's own ``store_many``. A node that joins nearer to the key unheard of by this node does not get the entries
stored meanwhile, for at most ``REMEMBER``; readers still find them on the other nearest nodes, which their narrow
search also asks (``peer.network.swarm``, "search width").

Records are signed and the local copy validated exactly as ``DHTNode.store_many`` does.
"""

from __future__ import annotations

import asyncio
import time

REMEMBER = 300.0  # seconds a key's nearest nodes are reused for, unless the routing table knows a nearer node
REMEMBER_FEW = 5.0  # seconds, when the lookup found fewer nodes than the replicas asked for (a small swarm)
_nearest: dict = {}  # key DHTID -> (monotonic time it is forgotten, {node DHTID: PeerID}) in this DHT process
_background: set = set()  # replica stores still running after the call returned


async def store_near(node, items: list, replicas: int, all_replicas: bool, also: tuple = ()) -> list[bool]:
    """Store ``(key, subkey, value, expiration)`` items on each key's ``replicas`` nearest nodes; per item, whether
    a replica took it. ``all_replicas=False`` returns at the first replica that took them all. ``also``: peer ids
    (base58) that get the same signed records too, in the background (their nodes validate them as a replica's
    does; they do not count as replicas, and one that does not answer changes nothing)."""
    from hivemind.dht.routing import DHTID

    by_key: dict = {}
    for i, (key, *_) in enumerate(items):
        by_key.setdefault(DHTID.generate(source=key), []).append(i)
    stored = [False] * len(items)
    results = await asyncio.gather(
        *(
            _store_key(node, key_id, [items[i] for i in idx], replicas, all_replicas, also)
            for key_id, idx in by_key.items()
        )
    )
    for idx, oks in zip(by_key.values(), results, strict=True):
        for i, ok in zip(idx, oks, strict=True):
            stored[i] = ok
    return stored


async def _store_key(node, key_id, items: list, replicas: int, all_replicas: bool, also: tuple) -> list[bool]:
    from hivemind.p2p import PeerID

    nearest = await _nearest_nodes(node, key_id, replicas)
    subkeys = [subkey for _, subkey, _, _ in items]
    expirations = [expiration for *_, expiration in items]
    records = [_signed(node, key_id, subkey, value, expiration) for _, subkey, value, expiration in items]
    stored = [False] * len(items)

    def send(peer_id):
        return _send(node, peer_id, key_id, subkeys, records)

    tasks = []
    for node_id, peer_id in nearest.items():
        if node_id == node.node_id:
            validator = node.protocol.record_validator
            for i, (subkey, record) in enumerate(zip(subkeys, records, strict=True)):
                if validator is None or validator.validate(record):
                    stored[i] |= node.protocol.storage.store(
                        key_id, record.value, record.expiration_time, subkey=subkey
                    )
        else:
            tasks.append(send(peer_id))
    for peer_id in {PeerID.from_base58(p) for p in also} - set(nearest.values()) - {node.peer_id}:
        _keep(send(peer_id))
    pending = set(tasks)
    while pending and not (all(stored) and not all_replicas):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            answer = task.result()
            if answer is None:  # no answer: look this key's nodes up again next time
                _nearest.pop(key_id, None)
                continue
            stored = [a or bool(b) for a, b in zip(stored, answer, strict=True)]
    for task in pending:
        _keep(task)
    if any(stored):
        return stored
    _nearest.pop(key_id, None)  # nobody took them: let hivemind look the key up and try every candidate
    found = await node.store_many(
        [key for key, *_ in items],
        [value for _, _, value, _ in items],
        expirations,
        subkeys=subkeys,
        await_all_replicas=all_replicas,
        beam_size=replicas,
        num_workers=replicas,
    )
    return [bool(found.get((key, subkey))) for key, subkey, _, _ in items]


async def push(node, items: list, peers: tuple) -> int:
    """Send ``(key, subkey, value, expiration)`` items, signed, to the nodes of ``peers`` (base58 ids) in the
    background and return at once: a copy for peers that watch their own node's storage (an adapter announcement
    for its followers), not a replica store (their nodes validate the records as a replica's does; one that does not
    answer changes nothing). Returns how many peers it was sent to."""
    from hivemind.p2p import PeerID

    await deliver(node, items, peers, wait=0.0)
    return len({PeerID.from_base58(p) for p in peers} - {node.peer_id})


DELIVER_WAIT = 1.0  # s a delivery waits for the peers to take the records (then the caller stores them as usual)


async def deliver(node, items: list, peers: tuple, wait: float = DELIVER_WAIT) -> list[bool]:
    """Send ``(key, subkey, value, expiration)`` items, signed, to the nodes of ``peers`` (base58 ids) and wait up to
    ``wait`` s for them: per item, whether one of those nodes took it (validated it as a replica does). A bucket
    entry a learner took needs no replica (``peer.network.buckets``). Sends still running at the deadline go on in
    the background."""
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID

    by_key: dict = {}
    for i, (key, *_) in enumerate(items):
        by_key.setdefault(DHTID.generate(source=key), []).append(i)
    targets = {PeerID.from_base58(p) for p in peers} - {node.peer_id}
    stored = [False] * len(items)
    tasks = {}
    for key_id, idx in by_key.items():
        records = [_signed(node, key_id, items[i][1], items[i][2], items[i][3]) for i in idx]
        for peer_id in targets:
            tasks[_send(node, peer_id, key_id, [items[i][1] for i in idx], records)] = idx
    pending, deadline = set(tasks), time.monotonic() + wait
    while pending and not all(stored) and (left := deadline - time.monotonic()) > 0:
        done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            answer = task.result()
            for i, took in zip(tasks[task], answer or (), strict=False):
                stored[i] |= bool(took)
    for task in pending:
        _keep(task)
    return stored


def _send(node, peer_id, key_id, subkeys: list, records: list):
    """One store request of the signed ``records`` (under ``key_id``, with their ``subkeys``) to ``peer_id``: a
    task that answers what the peer's node took, or None if it did not answer."""
    return asyncio.create_task(
        node.protocol.call_store(
            peer_id,
            keys=[key_id] * len(records),
            values=[r.value for r in records],
            expiration_time=[r.expiration_time for r in records],
            subkeys=subkeys,
        )
    )


async def _nearest_nodes(node, key_id, replicas: int) -> dict:
    now = time.monotonic()
    known = _nearest.get(key_id)
    if known is not None and now < known[0] and not _nearer_known(node, key_id, known[1], replicas):
        return known[1]
    found = await node.find_nearest_nodes([key_id], k_nearest=replicas, beam_size=replicas, num_workers=replicas)
    nearest = found[key_id]  # includes this node when it is one of the nearest
    if nearest:
        # a swarm smaller than the replicas asked for may be forming (the next joiner is a nearest node): its nodes
        # are looked up again sooner. Never remembering them made every store in a swarm of 2-4 nodes (the demo's,
        # a small private one) a lookup of 3 requests first: half of a learner's requests in the demo
        _nearest[key_id] = (now + (REMEMBER if len(nearest) >= replicas else REMEMBER_FEW), nearest)
    for stale in [k for k, (until, _) in _nearest.items() if now >= until]:
        del _nearest[stale]
    return nearest


def _nearer_known(node, key_id, nearest: dict, replicas: int) -> bool:
    """Whether this node's routing table holds a node that belongs among ``key_id``'s ``replicas`` nearest and is
    not in ``nearest`` (a local lookup: no request)."""
    table = node.protocol.routing_table.get_nearest_neighbors(key_id, replicas, exclude=node.node_id)
    farthest = max(key_id.xor_distance(n) for n in nearest)
    return any(n not in nearest and (len(nearest) < replicas or key_id.xor_distance(n) < farthest) for n, _ in table)


def _keep(task) -> None:
    """Hold a task that outlives the call (the event loop keeps only weak references)."""
    _background.add(task)
    task.add_done_callback(_background.discard)


def _signed(node, key_id, subkey, value, expiration):
    import dataclasses

    from hivemind.dht.crypto import DHTRecord

    serializer = node.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    if node.protocol.record_validator is not None:
        record = dataclasses.replace(record, value=node.protocol.record_validator.sign_value(record))
    return record
