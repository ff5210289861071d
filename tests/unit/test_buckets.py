"""Bucket logic on the in-memory backend (the DHT backend is exercised by tests/integration/test_swarm.py)."""

from types import SimpleNamespace

from peer.network.buckets import DHTBucketStore, MemoryBucketStore, ids
from peer.protocol import BUCKET_RING
from tests.helpers.records import make_group

PID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_each_peer_sees_every_peers_groups_in_the_version_range_once():
    shared, now = {}, [1000.0]
    a = MemoryBucketStore(b"ssh-rsa A", shared, clock=lambda: now[0])
    b = MemoryBucketStore(b"ssh-rsa B", shared, clock=lambda: now[0])
    for v in range(4):
        a.publish(make_group(version=v, seq=0))
        b.publish(make_group(version=v, seq=1))
    got = b.fetch(1, 2)
    assert sorted((f.owner, f.version, f.seq) for f in got) == [
        (b"ssh-rsa A", 1, 0),
        (b"ssh-rsa A", 2, 0),
        (b"ssh-rsa B", 1, 1),
        (b"ssh-rsa B", 2, 1),
    ]
    assert all(f.group is not None and f.error is None for f in got)
    assert b.fetch(1, 2, seen=ids(got)) == []  # nothing twice
    a.publish(make_group(version=2, seq=5))
    assert [(f.owner, f.version, f.seq) for f in b.fetch(1, 2, seen=ids(got))] == [(b"ssh-rsa A", 2, 5)]
    now[0] += a.expiration + 1
    assert a.fetch(0, 3) == []  # entries expire by themselves


def test_version_ranges_are_bounded_by_the_ring_and_empty_when_inverted():
    store = MemoryBucketStore(b"ssh-rsa A")
    store.publish(make_group(version=0, seq=0))
    store.publish(make_group(version=BUCKET_RING + 5, seq=0))
    assert [f.version for f in store.fetch(0, BUCKET_RING + 5)] == [BUCKET_RING + 5]  # older than a ring: not read
    assert store.fetch(3, 2) == [] and store.fetch(-5, -1) == []


def test_a_corrupt_entry_is_reported_not_raised():
    store = MemoryBucketStore(b"ssh-rsa A")
    store.publish(make_group(version=1, seq=0))
    expires, data = store.entries[(b"ssh-rsa A", 1, 0)]
    store.entries[(b"ssh-rsa A", 1, 0)] = (expires, data[:-7])
    store.entries[(b"ssh-rsa A", 1, 9)] = (expires, data)  # says seq 0 inside, 9 outside
    got = {f.seq: f for f in store.fetch(1, 1)}
    assert got[0].group is None and "not valid msgpack" in got[0].error
    assert got[9].group is None and "its entry 1.9" in got[9].error


def test_each_buckets_reads_search_narrowly_except_one_wide_read_every_few_seconds():
    searches, now = [], [100.0]
    swarm = SimpleNamespace(run_id="r", get_dict=lambda key, narrow: searches.append((key, narrow)) or {})
    store = DHTBucketStore(swarm, wide_every=5.0, clock=lambda: now[0])

    def widths(read):
        searches.clear()
        read()
        return [narrow for _, narrow in searches]

    assert widths(lambda: store.fetch(3, 4)) == [True, True], "a bucket's first reads are narrow"
    now[0] = 102.0
    assert widths(lambda: store.fetch(4, 5)) == [True, True]
    now[0] = 105.0
    assert widths(lambda: store.count(3, 5)) == [False, False, True], "5 s after their first reads, 3 and 4 go wide"
    assert widths(lambda: store.fetch(3, 5)) == [True, True, True]
    now[0] = 107.0
    assert widths(lambda: store.fetch(3, 5)) == [True, True, False], "each version on its own clock"
    assert len({key for key, _ in searches}) == 3
    assert widths(lambda: DHTBucketStore(swarm, narrow=False).fetch(3, 4)) == [False, False]


def test_a_reader_with_pushed_copies_reads_its_own_node_and_the_network_only_now_and_then():
    calls, now = [], [100.0]
    swarm = SimpleNamespace(
        run_id="r",
        wait_local=lambda skips, since, timeout: (
            calls.extend(("local", k) for k in skips) or (0, dict.fromkeys(skips, {}))
        ),
        get_dict=lambda key, narrow: calls.append(("network", key)) or {},
    )
    store = DHTBucketStore(swarm, network_every=1.0, clock=lambda: now[0])

    def reads(version: int) -> list[str]:
        calls.clear()
        store.fetch(version, version)
        return [where for where, _ in calls]

    assert reads(3) == ["local"], "a bucket's first read is the pushed copy alone"
    now[0] = 100.9
    assert reads(3) == ["local"]
    now[0] = 101.0
    assert reads(3) == ["local", "network"], "then the network once a second"
    assert reads(3) == ["local"]


def test_a_writer_delivers_its_entries_to_the_learners_and_stores_on_replicas_only_what_none_took():
    calls, taken = [], [True]
    swarm = SimpleNamespace(
        run_id="r",
        public_key=b"ssh-rsa A",
        peer_id=PID,
        deliver=lambda items, peers, what: calls.append(("deliver", peers)) or taken * len(items),
        store_many=lambda items, what, all_replicas, narrow, replicas: (
            calls.append(("store", narrow, replicas)) or [True] * len(items)
        ),
    )

    def publish(seq: int, **kwargs) -> list:
        calls.clear()
        DHTBucketStore(swarm, **kwargs).publish(make_group(version=2, seq=seq))
        return list(calls)

    learner = {"push_to": lambda: ("QmLearner",)}
    assert publish(0, **learner) == [("deliver", ("QmLearner",))], "a learner took it: no replica"
    taken[0] = False
    assert publish(1, **learner) == [("deliver", ("QmLearner",)), ("store", True, 2)], "none took it: 2 replicas"
    assert publish(2, narrow=False, **learner) == [("store", False, 2)], "a wide store delivers nothing"
    assert publish(3, push_to=lambda: ()) == [("store", True, 2)], "no learner known: the replicas"
    assert publish(4) == [("store", True, 2)]


def test_entries_whose_groups_a_reader_has_are_left_out_of_its_next_reads_of_its_own_node():
    """What the caller already had all groups of is not decoded and sent through the DHT pipe again: its subkey's
    tag goes with every later read of the node's own copy (the real node skips those, tests/integration)."""
    from hivemind.utils.timed_storage import ValueWithExpiration

    from peer.network.swarm import subkey_tag
    from peer.protocol import BucketEntry, group_subkey, to_dht_value

    owner = b"ssh-rsa A"
    subkey = group_subkey(owner, 3, 0)
    held = {subkey: ValueWithExpiration(to_dht_value(BucketEntry.of_groups([make_group(version=3, seq=0)])), 1e12)}
    skips = []

    def wait_local(keys, since, timeout):
        ((_, skip),) = keys.items()
        skips.append(set(skip))
        return 0, {key: {k: v for k, v in held.items() if subkey_tag(k) not in skip} for key in keys}

    swarm = SimpleNamespace(run_id="r", wait_local=wait_local, get_dict=lambda key, narrow: {})
    store = DHTBucketStore(swarm, network_every=60.0)
    got = store.fetch(3, 3)
    assert [(f.owner, f.version, f.seq) for f in got] == [(owner, 3, 0)] and skips[-1] == set()
    assert store.fetch(3, 3, seen=ids(got)) == [] and skips[-1] == set(), "read again: the caller had it"
    assert store.fetch(3, 3, seen=ids(got)) == [] and skips[-1] == {subkey_tag(subkey)}, "then left out"
    assert store.fetch(4, 4) == [] and skips[-1] == set(), "per version"
    assert store.fetch(67, 67) == [] and skips[-1] == set(), "version 67 shares version 3's ring slot"
    assert store.fetch(67, 67) == [] and skips[-1] == {subkey_tag(subkey)}, "its other versions are then left out"
    banned = DHTBucketStore(swarm, network_every=60.0)
    assert banned.fetch(3, 3, skip={owner}) == [] and skips[-1] == set()
    assert banned.fetch(3, 3, skip={owner}) == [] and skips[-1] == {subkey_tag(subkey)}, "a banned signer's: left out"
    assert store.count(3, 3) == 1 and skips[-1] == set(), "a count leaves nothing out"
