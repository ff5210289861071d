"""The swarm layer with real peers in real processes on loopback: joining, buckets, blobs, heartbeats, validators."""

import concurrent.futures
import contextlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.records import make_group
from tests.helpers.swarm import know_each_other
from tests.helpers.waiting import wait_until

PEER = Path(__file__).parents[1] / "procs" / "bucket_peer.py"
pytestmark = pytest.mark.integration


def wait_for(path: Path, peers, timeout: float = 120.0) -> dict:
    """The JSON a peer writes to ``path``, once it is there."""
    wait_until(path.exists, path.name, timeout, peers)
    return json.loads(path.read_text())


@pytest.fixture
def peers(procs, tmp_path):
    """``start(name, *args)`` runs a bucket peer; at the end DIR/stop lets them all shut down cleanly."""
    started = []

    def start(name, *args):
        started.append(procs.start_argv(name, [str(PEER), str(tmp_path), name, *args]))
        return started[-1]

    try:
        yield start, started, tmp_path
    finally:
        (tmp_path / "stop").touch()
        for p in started:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the procs fixture ends it
                p.wait(timeout=20)


@pytest.mark.timeout(240)
def test_three_peers_see_each_others_groups_and_refuse_a_liars_records(peers):
    start, procs, d = peers
    expect = ("--expect", "3", "--expect-groups", str(3 * 3 + 1))  # three peers' 3 groups, and a's big one
    start("a", "--groups", "3", "--big", "1", *expect)
    a = wait_for(d / "a.addr", procs)
    for name in ("b", "c"):
        start(name, "--initial-peers", *a["maddrs"], "--groups", "3", *expect)
    addrs = {n: wait_for(d / f"{n}.addr", procs) for n in ("b", "c")} | {"a": a}
    start("liar", "--liar", "--initial-peers", *a["maddrs"], "--forge", a["owner"])
    liar = wait_for(d / "liar.json", procs)
    reports = {n: wait_for(d / f"{n}.json", procs) for n in ("a", "b", "c")}

    owners = {addrs[n]["owner"] for n in "abc"}
    expected = {(addrs[n]["owner"], seq % 2, seq) for n in "abc" for seq in range(3)} | {(a["owner"], 0, 3)}
    for name, report in reports.items():
        seen = {(o, v, s) for o, v, s, _ in report["groups"]}
        assert seen == expected, f"{name} saw {sorted(seen)}"
        assert {o for o, *_ in report["groups"]} == owners  # nothing from the liar's key
        assert report["errors"] == [], report["errors"]
        assert report["peers"] == sorted(addrs[n]["peer_id"] for n in "abc")
        assert (report["rollout_peers"], report["learner_peers"]) == (3, 0)
        # the forged entry under a's subkey changed nothing: a's group 0 still has a's own tokens
        a0 = [t for o, v, s, t in report["groups"] if (o, v, s) == (a["owner"], 0, 0)]
        assert a0 == [[3] * 5], a0
        big = [t for o, v, s, t in report["groups"] if (o, v, s) == (a["owner"], 0, 3)]
        assert big == [[6] * 1000], "the large group did not arrive through its blob"
    assert liar["bad_schema"] is False and liar["bad_peer_record"] is False
    assert liar.get("forged") is False


@pytest.mark.timeout(300)
def test_in_a_swarm_wider_than_the_narrow_search_every_peer_still_sees_every_group(peers):
    """Ten peers, more than the 5 nodes a narrow search asks: with narrow stores and narrow reads only, each peer
    sees the 30 groups all of them published once the swarm had formed."""
    start, procs, d = peers
    names = [f"p{i}" for i in range(10)]
    flags = ("--groups", "3", "--expect", "10", "--expect-groups", "30", "--wide-every", "inf", "--wait-go")
    start(names[0], *flags)
    first = wait_for(d / "p0.addr", procs)
    for name in names[1:]:
        start(name, "--initial-peers", *first["maddrs"], *flags)
    addrs = {n: wait_for(d / f"{n}.addr", procs, timeout=180) for n in names}
    ids = {addrs[n]["peer_id"] for n in names}

    def full_mesh() -> bool:  # every peer has every other in its routing table: the swarm has formed
        tables = {n: d / f"{n}.table" for n in names}
        return all(
            path.exists() and ids - {addrs[n]["peer_id"]} <= set(json.loads(path.read_text()))
            for n, path in tables.items()
        )

    wait_until(full_mesh, "every peer in every routing table", 60, procs)
    (d / "go").touch()
    reports = {n: wait_for(d / f"{n}.json", procs, timeout=180) for n in names}

    expected = {(addrs[n]["owner"], seq % 2, seq) for n in names for seq in range(3)}
    for name, report in reports.items():
        seen = {(o, v, s) for o, v, s, _ in report["groups"]}
        assert seen == expected, f"{name} missed {len(expected - seen)} of {len(expected)} groups"
        assert report["errors"] == [], report["errors"]


def test_unreachable_initial_peer_is_one_clear_error():
    from peer.network.swarm import NetworkConfig, SwarmJoinError, join

    bogus = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGC5z27ghG43a8Gy8UYaRniDcwNNRKzjcTztC7KggvzHK"
    started = time.time()
    with pytest.raises(SwarmJoinError, match="could not join the swarm through any of /ip4/127.0.0.1/tcp/9") as e:
        join(NetworkConfig.loopback([bogus], bootstrap_timeout=5, startup_timeout=15), "run")
    assert "check that these multiaddrs are current" in str(e.value)
    assert time.time() - started < 60


def test_oversized_record_is_refused_before_hivemind_and_the_dht_lives_on(tmp_path):
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import RecordTooLarge, owner_subkey, peers_key

    with join(NetworkConfig.loopback(identity_path=str(tmp_path / "id")), "run") as swarm:
        key = peers_key("run")
        with pytest.raises(RecordTooLarge, match="over the"):
            swarm.store(key, owner_subkey(swarm.public_key), {"x": b"\0" * 70_000}, time.time() + 30, "test record")
        assert swarm.dht.is_alive()
        assert swarm.dht.get("some-other-key") is None  # the DHT process still answers
        first_peer_id, first_key = swarm.peer_id, swarm.public_key
    with join(NetworkConfig.loopback(identity_path=str(tmp_path / "id")), "run") as again:
        assert (again.peer_id, again.public_key) == (first_peer_id, first_key), "identity did not persist"


def test_client_mode_peer_reads_and_writes_through_a_full_peer():
    from peer.network.heartbeat import Heartbeat, live_peers
    from peer.network.swarm import NetworkConfig, join

    with join(NetworkConfig.loopback(), "run") as full:
        with join(NetworkConfig.loopback(full.visible_maddrs(), client_mode=True), "run") as client:
            assert client.dht.client_mode
            beat = Heartbeat(client, "learner", interval=0.5).start()
            try:
                [seen] = wait_until(lambda: live_peers(full, role="learner"), "the client's heartbeat", 20)
                assert seen.record.peer_id == str(client.peer_id) and seen.record.reachable is False
                assert seen.owner == client.public_key
            finally:
                beat.stop()
            assert [p.record.state for p in live_peers(full, include_leaving=True)] == ["leaving"]
            assert live_peers(full) == []


@pytest.mark.timeout(120)  # before the fix the DHT process died and the caller hung
def test_large_records_stored_from_many_threads_at_once_keep_the_dht_alive():
    """Values near the 48 KiB limit, stored from several threads at once: each must land and the DHT live on
    (through the command pipe, a message over 16 KiB is written in two parts and can kill the DHT process)."""
    import threading

    from peer.network.buckets import DHTBucketStore
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import fits_inline

    def group(peer_id: str, version: int, seq: int):
        return _group(peer_id, version, seq, tokens=560)

    with join(NetworkConfig.loopback(), "run") as a, join(NetworkConfig.loopback(a.visible_maddrs()), "run") as b:
        store, errors = DHTBucketStore(b), []
        sample = group(str(b.peer_id), 0, 0)
        assert fits_inline(sample) and not fits_inline([sample, sample])  # ~36 KB: one group per entry

        def publish(thread: int) -> None:
            try:
                store.publish_many([group(str(b.peer_id), thread, seq) for seq in range(0, 24, 2)])  # 12 entries
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=publish, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and b.dht.is_alive() and a.dht.is_alive()
        assert [DHTBucketStore(a).count(v, v) for v in range(4)] == [12, 12, 12, 12]


def _group(peer_id: str, version: int, seq: int, tokens: int = 5):
    """Group ``seq`` of ``version`` by ``peer_id``: eight completions of ``tokens`` tokens each."""
    return make_group(version=version, seq=seq, producer=peer_id, completions=[[4] * tokens] * 8, created=time.time())


async def _lookups(_dht, node) -> int:
    """Runs in a DHT process: count the node's nearest-node lookups from now on; returns the count so far."""
    if not hasattr(node, "lookups"):
        original, node.lookups = node.find_nearest_nodes, 0

        async def counted(*args, **kwargs):
            node.lookups += 1
            return await original(*args, **kwargs)

        node.find_nearest_nodes = counted
    return node.lookups


REMEMBER_FEW_HERE = 1.0  # s: the test's REMEMBER_FEW (the peers' is 5 s)


async def _remember_few(_dht, node) -> None:
    """Runs in a DHT process: remember a set not full for REMEMBER_FEW_HERE s from now on."""
    from peer.network import near_store

    near_store.REMEMBER_FEW = REMEMBER_FEW_HERE


@pytest.mark.timeout(120)
def test_narrow_stores_look_a_key_up_once_and_again_after_a_replica_stops_answering():
    """Five peers (a full replica set): one lookup serves many stores to a key; a replica that stops answering
    makes the next store look the key up again; with four peers left (a set not full, as in a small swarm where the
    next joiner would be a replica) one lookup serves the stores of ``REMEMBER_FEW`` s only."""
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import BucketEntry, bucket_key, group_subkey, to_dht_value

    def store(version: int, seq: int) -> bool:
        entry = to_dht_value(BucketEntry.of_groups([_group(str(b.peer_id), version, seq)]))
        item = (bucket_key("run", version), group_subkey(b.public_key, version, seq), entry, time.time() + 60)
        return b.store_many([item], "bucket entry", all_replicas=True, narrow=True)[0]

    with contextlib.ExitStack() as stack:
        a = stack.enter_context(join(NetworkConfig.loopback(), "run"))
        b, c, d = (stack.enter_context(join(NetworkConfig.loopback(a.visible_maddrs()), "run")) for _ in range(3))
        e = join(NetworkConfig.loopback(a.visible_maddrs()), "run")
        try:
            wait_until(lambda: know_each_other([a, b, c, d, e]), "every peer in every routing table", 30)
            key, start = bucket_key("run", 0), b.dht.run_coroutine(_lookups)
            assert all(store(0, seq) for seq in range(3))
            assert b.dht.run_coroutine(_lookups) == start + 1, "one lookup for three stores to one key"
            assert store(1, 3) and b.dht.run_coroutine(_lookups) == start + 2
            for reader in (a, c, d, e):
                assert len(reader.get_dict(key, narrow=True)) == 3, "every replica took every narrow store"
        finally:
            e.shutdown()
        deadline, seq = time.time() + 60, 4
        while b.dht.run_coroutine(_lookups) == start + 2:  # e no longer answers: look the key up again
            assert time.time() < deadline, "a store to a replica that stopped answering never looked the key up again"
            assert store(0, seq), "a store still lands on the replicas that answer"
            seq += 1
        b.dht.run_coroutine(_remember_few)
        before = b.dht.run_coroutine(_lookups)
        assert store(2, seq) and store(2, seq + 1)
        assert b.dht.run_coroutine(_lookups) == before + 1, "four peers: the set is remembered, for a short while"
        time.sleep(REMEMBER_FEW_HERE)
        assert store(2, seq + 2) and b.dht.run_coroutine(_lookups) == before + 2, "and looked up again after it"
        assert len(a.get_dict(key, narrow=True)) == 3 + (seq - 4), "seqs 0-2 and 4 on: none lost"
        assert len(a.get_dict(bucket_key("run", 2), narrow=True)) == 3


async def _node_id(_dht, node) -> int:
    """Runs in a DHT process: the node's DHT id."""
    return int(node.node_id)


@pytest.mark.timeout(120)
def test_a_remembered_key_is_looked_up_again_once_a_nearer_node_is_known():
    """Five peers: the first store to each of the 64 bucket keys looks it up, a second one does not; after a sixth
    peer joined and the storing node heard of it, a store to each looks up exactly the keys whose 2 nearest nodes
    now include the sixth (a local check of the routing table, no request for the others), and lands on it there."""
    from hivemind.dht.routing import DHTID

    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import BUCKET_RING, BucketEntry, bucket_key, group_subkey, to_dht_value

    def store(version: int, seq: int) -> bool:
        entry = to_dht_value(BucketEntry.of_groups([_group(str(b.peer_id), version, seq)]))
        item = (bucket_key("run", version), group_subkey(b.public_key, version, seq), entry, time.time() + 60)
        return b.store_many([item], "bucket entry", all_replicas=True, narrow=True, replicas=2)[0]

    with contextlib.ExitStack() as stack:
        a = stack.enter_context(join(NetworkConfig.loopback(), "run"))
        b, c, d, e = (stack.enter_context(join(NetworkConfig.loopback(a.visible_maddrs()), "run")) for _ in range(4))
        wait_until(lambda: know_each_other([a, b, c, d, e]), "every peer in every routing table", 30)
        start = b.dht.run_coroutine(_lookups)
        assert all(store(v, 0) for v in range(BUCKET_RING))
        assert b.dht.run_coroutine(_lookups) == start + BUCKET_RING, "one lookup per key"
        assert all(store(v, 1) for v in range(BUCKET_RING))
        assert b.dht.run_coroutine(_lookups) == start + BUCKET_RING, "remembered: no lookup"

        f = stack.enter_context(join(NetworkConfig.loopback(a.visible_maddrs()), "run"))
        six = [a, b, c, d, e, f]
        wait_until(lambda: know_each_other(six), "the sixth peer in every routing table", 30)
        ids = [s.dht.run_coroutine(_node_id) for s in six]

        def nearest(version: int) -> list[int]:
            key_id = int(DHTID.generate(source=bucket_key("run", version)))
            return sorted(range(6), key=lambda i: ids[i] ^ key_id)[:2]

        near_f = [v for v in range(BUCKET_RING) if 5 in nearest(v)]
        assert 0 < len(near_f) < BUCKET_RING
        before = b.dht.run_coroutine(_lookups)
        assert all(store(v, 2) for v in range(BUCKET_RING))
        assert b.dht.run_coroutine(_lookups) == before + len(near_f), "a lookup for each key the sixth is near"
        for v in near_f:
            assert group_subkey(b.public_key, v, 2) in f.local_dict(bucket_key("run", v)), f"v{v} on the sixth"


@pytest.mark.timeout(120)
def test_an_entry_a_learner_took_is_stored_on_no_replica_and_one_none_took_on_the_nearest_nodes():
    """Five peers: a bucket store with ``push_to`` delivers the entry to that peer's node and to no other; once that
    peer is gone, the next entry goes to the key's nearest nodes instead, where any reader finds it."""
    from peer.network.buckets import DHTBucketStore
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import bucket_key, group_subkey

    with contextlib.ExitStack() as stack:
        a = stack.enter_context(join(NetworkConfig.loopback(), "run"))
        w, c, d = (stack.enter_context(join(NetworkConfig.loopback(a.visible_maddrs()), "run")) for _ in range(3))
        r = join(NetworkConfig.loopback(a.visible_maddrs()), "run")
        try:
            wait_until(lambda: know_each_other([a, w, c, d, r]), "every peer in every routing table", 30)
            store = DHTBucketStore(w, push_to=lambda: (str(r.peer_id),))
            key, first = bucket_key("run", 3), group_subkey(w.public_key, 3, 0)
            store.publish(_group(str(w.peer_id), 3, 0))
            assert list(r.local_dict(key)) == [first], "the learner's node took it"
            assert not any(s.local_dict(key) for s in (a, w, c, d)), "and no other node has it"
        finally:
            r.shutdown()
        store.publish(_group(str(w.peer_id), 3, 1))
        found = [set(s.get_dict(key, narrow=True)) for s in (a, c, d)]
        assert all(f == {group_subkey(w.public_key, 3, 1)} for f in found), "on the nearest nodes"
        held = sum(bool(s.local_dict(key)) for s in (a, w, c, d))
        assert 1 <= held <= 2, "on the key's 2 nearest nodes (one of which may have been the peer that left)"


@pytest.mark.timeout(120)
def test_a_pushed_entry_reaches_a_reader_that_is_no_replica_and_a_bad_one_is_refused_by_its_node():
    """Seven peers: on a bucket key the reader does not replicate, a narrow store leaves nothing in the reader's
    own node; the same store pushed to it does (its node validates it like a replica's), a wrong-schema one not."""
    from peer.network.swarm import NetworkConfig, join, subkey_tag
    from peer.protocol import BucketEntry, bucket_key, group_subkey, groups_of, to_dht_value

    with contextlib.ExitStack() as stack:
        a = stack.enter_context(join(NetworkConfig.loopback(), "run"))
        w, r, *others = (
            stack.enter_context(join(NetworkConfig.loopback(a.visible_maddrs()), "run")) for _ in range(6)
        )
        wait_until(lambda: know_each_other([a, w, r, *others]), "every peer in every routing table", 30)

        def store(version: int, seq: int, also=(), value=None) -> bool:
            entry = value or to_dht_value(BucketEntry.of_groups([_group(str(w.peer_id), version, seq)]))
            item = (bucket_key("run", version), group_subkey(w.public_key, version, seq), entry, time.time() + 60)
            return w.store_many([item], "bucket entry", all_replicas=True, narrow=True, also=also)[0]

        for version in range(64):  # a key whose 5 nearest nodes leave the reader out
            assert store(version, 0)
            if not r.local_dict(bucket_key("run", version)):
                break
        else:
            pytest.fail("the reader replicated every key")
        key, to_r = bucket_key("run", version), (str(r.peer_id),)
        assert len(r.get_dict(key, narrow=True)) == 1, "the replicas have it"
        assert not store(version, 1, to_r, value={"inline": "not a bucket entry"})
        assert store(version, 2, to_r)
        held = wait_until(lambda: r.local_dict(key), "the pushed entry in the reader's own node", 10)
        assert [group_subkey(w.public_key, version, 2)] == list(held), "the pushed entry and only it"
        got = BucketEntry.parse_obj(held[group_subkey(w.public_key, version, 2)].value)
        assert [g.seq for g in groups_of(got.inline, version, 2, 1)] == [2]
        tag = subkey_tag(group_subkey(w.public_key, version, 2))
        assert r.local_dict(key, skip={tag}) == {}, "an entry the reader has is left out, in the DHT process"
        assert r.local_dict(key, skip={tag ^ 1}).keys() == held.keys()

        # a reader waits in its DHT process for the next store into the keys it reads, instead of polling them
        since, found = r.wait_local({key: {tag}}, -1, 30.0)
        assert found == {key: {}}, "-1: at once, whatever the timeout"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(r.wait_local, {key: {tag}}, since, 30.0)
            assert store(version + 1, 0, to_r)
            time.sleep(1.0)
            assert not waiter.done(), "a store into another key wakes nobody waiting on this one"
            assert store(version, 3, to_r)
            count, found = waiter.result(timeout=10)
        assert count > since and list(found[key]) == [group_subkey(w.public_key, version, 3)], "the new entry"
        started = time.monotonic()
        assert r.wait_local({key: {tag}}, count, 0.5) == (count, found), "nothing new: the same, after the timeout"
        assert time.monotonic() - started >= 0.5


async def _peer_id_of(_dht, node) -> str:
    return str(node.peer_id)


async def _refuse(what: str, _dht, node):
    raise ValueError(f"refused {what}")


async def _sleep(seconds: float, _dht, node) -> float:
    import asyncio

    await asyncio.sleep(seconds)
    return seconds


@pytest.mark.timeout(60)
def test_calls_take_the_side_channel_side_by_side_and_fail_clearly_once_the_dht_process_is_gone():
    """The frequent calls go over the DHT process's Unix socket (peer.network.calls), not hivemind's pipe: what the
    function returns or raises comes back; one thread's long call does not hold another's; a call after the DHT
    process ended is a ConnectionError, not a wait forever."""
    from functools import partial

    from peer.network.swarm import NetworkConfig, join

    swarm = join(NetworkConfig.loopback(), "run")
    try:
        assert swarm._calls is not None, "joining opens the side channel"
        assert swarm.call(_peer_id_of) == str(swarm.peer_id) == swarm.dht.run_coroutine(_peer_id_of)
        with pytest.raises(ValueError, match="refused this"):
            swarm.call(partial(_refuse, "this"))
        assert swarm.call(_peer_id_of) == str(swarm.peer_id), "the connection lives on after an exception"
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(swarm.call, partial(_sleep, 3.0))
            started = time.monotonic()
            assert pool.submit(swarm.call, partial(_sleep, 0.1)).result(timeout=10) == 0.1
            assert time.monotonic() - started < 2.0 and not slow.done(), "another thread's call is not queued"
            assert slow.result(timeout=10) == 3.0
    finally:
        swarm.dht.shutdown()
    with pytest.raises(ConnectionError, match="DHT process did not answer"):
        swarm.call(_peer_id_of)
    swarm.shutdown()


def test_learners_others_can_reach_are_named_for_pushes_not_client_mode_ones():
    from peer.network.heartbeat import Heartbeat, Reachable
    from peer.network.swarm import NetworkConfig, join

    with contextlib.ExitStack() as stack:
        full = stack.enter_context(join(NetworkConfig.loopback(), "run"))
        learner = stack.enter_context(join(NetworkConfig.loopback(full.visible_maddrs()), "run"))
        client = stack.enter_context(join(NetworkConfig.loopback(full.visible_maddrs(), client_mode=True), "run"))
        beats = [Heartbeat(s, role, interval=0.5).start() for s, role in ((learner, "learner"), (client, "learner"))]
        beats.append(Heartbeat(full, "learner", interval=0.5).start())
        try:
            reachable = Reachable(full, "learner", every=0.0)
            wait_until(lambda: reachable() == (str(learner.peer_id),), "only the reachable learner named", 20)
            assert Reachable(learner, "learner", every=0.0)() == (str(full.peer_id),), "never itself"
        finally:
            for beat in beats:
                beat.stop()
