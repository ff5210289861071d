"""Spreading adapter versions: a seeding server sends a new blob to a couple of peers and tells the rest to ask
them; ``--max-upload`` caps what a server sends; holder records are bounded and checked; a fetch asks listed holders
first and waits out "seeded" answers. Real P2P daemons in this process for the wire, pure logic for the rest."""

import asyncio
import functools
import os
import time
from types import SimpleNamespace

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from peer.network.blobs import BlobCache, BlobServer, BlobUnavailable, fetch_blob
from peer.network.blobs.server import MIN_UPLOAD, Seeding, UploadLimit
from peer.network.holders import HOLDERS_WANTED, BadHolders, advertise, read_holders
from peer.protocol import HolderRecord, holders_key, owner_subkey, to_dht_value
from peer.protocol.limits import HOLDER_RING
from peer.run import adapters
from peer.run.adapters import Announcement, fetch_adapter, fetch_version
from tests.helpers.dict_swarm import DictSwarm
from tests.helpers.p2p import with_peers
from tests.helpers.waiting import wait_until

SHA = "ab" * 32


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- seeding and the upload limit, pure -------------------------------------------------------------------------


def test_a_seeded_blob_goes_to_its_copies_then_to_nobody_else_until_the_grace_ends():
    clock = Clock()
    seeding = Seeding(copies=2, grace=3.0, clock=clock)
    assert seeding.admit("A", SHA) is None  # not seeded: anyone
    seeding.seed(SHA, exempt=["L2"])
    assert seeding.admit("A", SHA) is None and seeding.admit("B", SHA) is None
    refused = seeding.admit("C", SHA)
    assert refused is not None and refused.startswith("seeded:") and "went to 2 peers" in refused
    assert seeding.admit("L2", SHA) is None  # another learner: always
    assert seeding.copies_of(SHA) == 2
    clock.now += 2.9
    assert seeding.admit("C", SHA) is not None
    clock.now += 0.1
    assert seeding.admit("C", SHA) is None  # the grace is over: holders did not deliver in time
    seeding.seed(SHA)  # seeding it again changes nothing (a re-announcement)
    assert seeding.admit("D", SHA) is None and seeding.copies_of(SHA) == 2  # past the grace: not counted


def test_seeding_remembers_its_newest_blobs_only():
    seeding = Seeding(copies=1, remember=3)
    shas = [f"{i:064x}" for i in range(5)]
    for sha in shas:
        seeding.seed(sha)
        seeding.admit("A", sha)
    assert [seeding.admit("B", sha) is None for sha in shas] == [True, True, False, False, False]


def test_the_upload_limit_lets_a_second_through_then_spaces_the_rest_at_its_rate():
    clock = Clock()
    limit = UploadLimit(1000.0, clock=clock)
    assert limit.delay(1000) == 0.0  # a second's worth at once
    assert limit.delay(500) == pytest.approx(0.5)
    clock.now += 0.5
    assert limit.delay(500) == pytest.approx(0.5)  # 0.5 s refilled 500, spent 500: still 500 behind
    clock.now += 10
    assert limit.delay(200) == 0.0  # idle time refills at most a second's worth
    assert limit.delay(900) == pytest.approx(0.1)


def test_a_server_with_an_upload_limit_has_as_many_slots_as_the_rate_carries(tmp_path):
    p2p = SimpleNamespace(peer_id="me")
    cache = BlobCache(tmp_path)
    assert BlobServer(p2p, cache, max_upload=MIN_UPLOAD).max_streams == 1
    assert BlobServer(p2p, cache, max_upload=3.5 * MIN_UPLOAD).max_streams == 3
    assert BlobServer(p2p, cache, max_upload=1e12).max_streams == BlobServer(p2p, cache).max_streams
    with pytest.raises(ValueError, match="max_upload must be at least"):
        BlobServer(p2p, cache, max_upload=MIN_UPLOAD - 1)


# --- seeding and the upload limit over real P2P daemons ---------------------------------------------------------


def test_a_seeding_server_serves_two_peers_and_the_third_gets_it_from_one_of_them(tmp_path):
    data = os.urandom(300_000)

    async def scenario(server_p2p, clients):
        a, b, c, learner = clients
        store = BlobCache(tmp_path / "server")
        sha = store.put_bytes(data)
        seeding = Seeding(copies=2, grace=60.0)
        seeding.seed(sha, exempt=[learner.peer_id.to_base58()])
        caches = {p.peer_id: BlobCache(tmp_path / p.peer_id.to_base58()) for p in clients}
        async with BlobServer(server_p2p, store, seeding=seeding) as server, BlobServer(a, caches[a.peer_id]):
            for p in (a, b):
                assert (
                    await fetch_blob(p, sha, len(data), [server_p2p.peer_id], caches[p.peer_id])
                ).read_bytes() == data
            with pytest.raises(BlobUnavailable) as refused:
                await fetch_blob(c, sha, len(data), [server_p2p.peer_id], caches[c.peer_id])
            assert adapters._retry_later(refused.value.reasons[server_p2p.peer_id.to_base58()])
            assert server.stats.seeded == 1 and server.stats.served == 2
            assert sorted(refused.value.hints) == sorted(p.peer_id.to_base58() for p in (a, b))  # whom it gave it
            got = await fetch_blob(c, sha, len(data), [a.peer_id], caches[c.peer_id])  # from a holder
            assert got.read_bytes() == data
            got = await fetch_blob(learner, sha, len(data), [server_p2p.peer_id], caches[learner.peer_id])
            assert got.read_bytes() == data  # another learner is served whatever the count
            assert server.stats.bytes_sent == 3 * len(data)

    asyncio.run(with_peers(4, scenario))


def test_a_peer_passing_an_adapter_on_sends_it_to_two_peers_at_a_time_and_names_them_to_the_third(tmp_path):
    from peer.network.blobs import drip

    data = os.urandom(3 * (64 << 10))

    async def scenario(server_p2p, clients):
        store = BlobCache(tmp_path / "server")
        sha = store.put_bytes(data)
        seeding = Seeding()
        seeding.pass_on(sha)
        server = BlobServer(server_p2p, store, seeding=seeding, transform=drip(0.3), chunk_size=64 << 10)
        async with server:
            fetches = [
                fetch_blob(p, sha, len(data), [server_p2p.peer_id], BlobCache(tmp_path / str(i)))
                for i, p in enumerate(clients)
            ]
            done = await asyncio.gather(*fetches, return_exceptions=True)
        served = [d for d in done if not isinstance(d, BaseException)]
        refused = [d for d in done if isinstance(d, BlobUnavailable)]
        assert len(served) == 2 and len(refused) == 1, done
        assert "sending this blob to 2 peers already" in str(refused[0])
        assert server.stats.served == 2

    asyncio.run(with_peers(3, scenario))


def test_a_server_never_sends_faster_than_its_upload_limit(tmp_path):
    data = os.urandom(3 * MIN_UPLOAD)

    async def scenario(server_p2p, clients):
        store = BlobCache(tmp_path / "server")
        sha = store.put_bytes(data)
        async with BlobServer(server_p2p, store, max_upload=MIN_UPLOAD, chunk_size=64 << 10):
            start = time.monotonic()
            path = await fetch_blob(clients[0], sha, len(data), [server_p2p.peer_id], BlobCache(tmp_path / "c"))
            took = time.monotonic() - start
        assert path.read_bytes() == data
        assert took >= 1.8, f"3 s of data at the limit (a second's burst allowed) came in {took:.2f} s"

    asyncio.run(with_peers(1, scenario))


# --- holder records ---------------------------------------------------------------------------------------------


class HolderSwarm(DictSwarm):
    config = SimpleNamespace(client_mode=False)

    def visible_maddrs(self):
        return []


def test_learners_and_the_host_beat_in_the_small_table_too_and_are_looked_up_there_alone():
    from peer.network.heartbeat import Heartbeat, live_peers
    from peer.protocol import core_peers_key, peers_key

    ids = {"learner": "QmLearn", "rollout": "QmRo"}
    swarms = {role: HolderSwarm(RSAPrivateKey(), "run", peer_id=peer_id) for role, peer_id in ids.items()}
    records = {}
    for role, swarm in swarms.items():
        swarm.records = records  # one DHT
        assert Heartbeat(swarm, role).beat()
    assert len(records[peers_key("run")]) == 2 and len(records[core_peers_key("run")]) == 1
    reader = swarms["rollout"]
    reader.reads = 0
    assert [p.record.peer_id for p in live_peers(reader, "learner")] == ["QmLearn"]
    assert reader.reads == 1
    assert [p.record.peer_id for p in live_peers(reader, "rollout")] == ["QmRo"]
    assert {p.record.peer_id for p in live_peers(reader)} == {"QmLearn", "QmRo"}


def _holder(swarm: DictSwarm, key: RSAPrivateKey, peer_id: str, version=7, sha=SHA, size=1000, created=1.0):
    record = HolderRecord(peer_id=peer_id, version=version, sha256=sha, size=size, created=created)
    pub = key.get_public_key().to_bytes()
    swarm.records.setdefault(holders_key(swarm.run_id, version), {})[owner_subkey(pub)] = to_dht_value(record)
    return pub


def test_holders_of_a_version_are_the_signers_of_those_bytes_newest_first():
    swarm = HolderSwarm(RSAPrivateKey(), "run")
    _holder(swarm, RSAPrivateKey(), "QmA", created=1.0)
    _holder(swarm, RSAPrivateKey(), "QmB", created=2.0)
    _holder(swarm, RSAPrivateKey(), "QmC", sha="cd" * 32)  # other bytes
    _holder(swarm, RSAPrivateKey(), "QmD", size=999)  # another size
    _holder(swarm, RSAPrivateKey(), "QmA", created=3.0)  # the same peer id twice: once
    swarm.records[holders_key("run", 7)][b"junk"] = b"\x00"
    assert read_holders(swarm, 7, SHA, 1000) == ["QmA", "QmB"]
    assert read_holders(swarm, 7 + HOLDER_RING, SHA, 1000) == []  # same slot, another version


def test_a_holder_that_failed_is_not_asked_again_for_a_while():
    clock = Clock()
    bad = BadHolders(forget=60.0, remember=2, clock=clock)
    bad.add(["QmA", "QmB"])
    assert "QmA" in bad and "QmC" not in bad
    bad.add(["QmC"])  # the oldest goes
    assert "QmA" not in bad and "QmB" in bad and "QmC" in bad
    clock.now += 60
    assert "QmB" not in bad and "QmC" not in bad


def test_a_peer_lists_itself_as_a_holder_on_the_nodes_a_narrow_read_asks_and_never_asks_itself():
    from peer.network.holders import HOLDER_REPLICAS

    swarm = HolderSwarm(RSAPrivateKey(), "run", peer_id="QmMe")
    how = []
    store_many = swarm.store_many
    swarm.store_many = lambda items, what, **kwargs: how.append(kwargs) or store_many(items, what, **kwargs)
    assert advertise(swarm, 7, SHA, 1000)
    assert how == [{"narrow": True, "replicas": HOLDER_REPLICAS}] and HOLDER_REPLICAS == 2, (
        "stored as a bucket entry is: on the key's 2 nearest nodes, remembered per ring slot"
    )
    (value,) = swarm.records[holders_key("run", 7)].values()
    assert value["peer_id"] == "QmMe" and value["version"] == 7
    assert read_holders(swarm, 7, SHA, 1000) == []


def test_the_validators_refuse_a_holder_record_in_another_versions_slot():
    from peer.protocol.validators import RunSchema

    key = RSAPrivateKey()
    record = HolderRecord(peer_id="QmA", version=3, sha256=SHA, size=10, created=1.0)
    subkey = owner_subkey(key.get_public_key().to_bytes())
    RunSchema.parse_obj({"holders_3": {subkey: record}})
    with pytest.raises(ValueError, match="belongs in slot 3"):
        RunSchema.parse_obj({"holders_4": {subkey: record}})


def test_a_holder_key_holds_at_most_64_kib_on_a_node():
    from peer.network.quota import MAX_HOLDERS_KEY_BYTES, KeyQuota

    quota = KeyQuota("holders_3")
    items = {f"[owner:k{i}]".encode(): (b"x" * 1000, 0.0) for i in range(MAX_HOLDERS_KEY_BYTES // 1012)}
    assert not quota.check(items, b"[owner:new]", b"x" * 1000, 10.0, 0.0).ok
    assert quota.check({}, b"[owner:new]", b"x" * 1000, 10.0, 0.0).ok
    assert not quota.check({}, b"[owner:new]", b"x", 400.0, 0.0).ok  # holders say so for seconds, not minutes


# --- a fetch's rounds, pure -------------------------------------------------------------------------------------


class Peer:
    """A base58 id, as hivemind's PeerID is compared and printed here."""

    def __init__(self, text: str):
        self.text = text

    def to_base58(self) -> str:
        return self.text

    def __eq__(self, other):
        return isinstance(other, Peer) and other.text == self.text

    def __hash__(self):
        return hash(self.text)


class FakeBlobs:
    """``answers[peer]``: None to deliver, else the reason that peer fails with; every call's order is kept."""

    def __init__(self, answers: dict[str, str | None]):
        self.answers, self.calls = answers, []

    def fetch(self, sha, size, order, **_):
        self.calls.append([p.to_base58() for p in order])
        reasons = {}
        for p in order:
            why = self.answers.get(p.to_base58(), "answered: does not have blob")
            if why is None:
                return SimpleNamespace(read_bytes=lambda: b"blob")
            reasons[p.to_base58()] = why
        raise BlobUnavailable("nobody", reasons)


@pytest.fixture
def peer_ids(monkeypatch):
    from hivemind import p2p

    monkeypatch.setattr(p2p.PeerID, "from_base58", staticmethod(Peer))


def test_listed_holders_come_before_the_announcers(peer_ids):
    blobs = FakeBlobs({"H1": None, "H2": None, "L": None})
    assert fetch_adapter(blobs, SHA, 10, ["L"], None, 1.0, holders=lambda: ["H1", "H2", "L"]) == b"blob"
    (order,) = blobs.calls
    assert sorted(order[:2]) == ["H1", "H2"] and order[2:] == ["L"]


def test_a_seeded_answer_makes_the_fetch_wait_for_holders_and_never_ask_a_failed_one_again(peer_ids):
    clock = Clock()
    bad = BadHolders(clock=clock)
    listed: list[str] = ["BAD"]
    blobs = FakeBlobs({"L": "answered: seeded: blob went to 2 peers already", "BAD": "sent bytes that do not match"})
    blobs.answers["SOON"] = "answered: does not have blob ab…"  # a holder not ready yet: asked again, not bad
    listed.append("SOON")

    def sleep(seconds):
        clock.now += seconds
        if clock.now > 100.5:
            listed.append("H")
            blobs.answers["H"] = None

    got = fetch_adapter(blobs, SHA, 10, ["L"], None, 1.0, holders=lambda: listed, bad=bad, clock=clock, sleep=sleep)
    assert got == b"blob"
    assert sorted(blobs.calls[0]) == ["BAD", "L", "SOON"] and all("BAD" not in c for c in blobs.calls[1:])
    assert all("SOON" in c for c in blobs.calls)
    assert "BAD" in bad and "SOON" not in bad and "L" not in bad and "H" not in bad
    assert sorted(blobs.calls[-1]) == ["H", "L", "SOON"] and 3 <= len(blobs.calls) <= 6


def test_peers_a_refusal_names_are_asked_first_in_the_next_round(peer_ids):
    class Hinting(FakeBlobs):
        def fetch(self, sha, size, order, **kw):
            try:
                return super().fetch(sha, size, order, **kw)
            except BlobUnavailable as e:
                raise BlobUnavailable("nobody", e.reasons, ["H1", "L"] if len(self.calls) == 1 else []) from None

    blobs = Hinting({"L": "answered: seeded: …", "H1": None})
    got = fetch_adapter(blobs, SHA, 10, ["L"], None, 1.0, holders=lambda: [], sleep=lambda _: None)
    assert got == b"blob" and blobs.calls == [["L"], ["H1", "L"]]  # an announcer named is not a holder


def test_past_its_patience_a_fetch_asks_the_other_live_peers(peer_ids):
    clock = Clock()

    def sleep(seconds):
        clock.now += seconds

    blobs = FakeBlobs({"L": "answered: seeded: …", "O": None})
    others = lambda: [Peer("L"), Peer("O")]  # noqa: E731
    got = fetch_adapter(blobs, SHA, 10, ["L"], others, 1.0, holders=lambda: [], patience=3.0, clock=clock, sleep=sleep)
    assert got == b"blob" and blobs.calls[-1] == ["O"]
    assert 6 <= len(blobs.calls) - 1 <= 10  # rounds 0.1, 0.2, 0.4, 0.8, 1, 1 s apart (±50 %) for the 3 s of patience


def test_a_fetch_that_nobody_can_serve_says_so_at_once_on_failures_that_will_not_change(peer_ids):
    blobs = FakeBlobs({"L": "was silent for 5 s"})
    with pytest.raises(BlobUnavailable):
        fetch_adapter(blobs, SHA, 10, ["L"], lambda: [], 1.0, holders=lambda: [])
    assert blobs.calls == [["L"]]


def test_a_follower_reads_the_announcements_less_often_when_versions_come_slowly():
    from peer.run.adapters import MAX_POLL, AdapterFollower

    follower = AdapterFollower(None, None, 0, interval=0.5)
    assert follower.poll_every() == 0.5  # nothing known yet
    follower.version_interval = 0.4  # the demo's pace
    assert follower.poll_every() == 0.5
    follower.version_interval = 4.0
    assert follower.poll_every() == 1.0
    follower.version_interval = 60.0  # a real model's
    assert follower.poll_every() == MAX_POLL


def test_a_follower_lists_itself_after_a_fetch_while_few_holders_are_listed(peer_ids):
    swarm = HolderSwarm(RSAPrivateKey(), "run", peer_id="QmMe")
    blobs = FakeBlobs({"L": None})
    blobs.server = object()
    found = Announcement(7, SHA, 1000, ("L",), 1)
    assert fetch_version(swarm, blobs, found, None, 1.0) == (b"blob", 0)
    swarm.peer_id = "QmOther"  # read as another peer would
    assert read_holders(swarm, 7, SHA, 1000) == ["QmMe"]
    full = HolderSwarm(RSAPrivateKey(), "run", peer_id="QmMe")
    for i in range(HOLDERS_WANTED):
        _holder(full, RSAPrivateKey(), "QmH" + "abcdefghjk"[i], sha=SHA, size=1000)
    blobs = FakeBlobs({"QmH" + "abcdefghjk"[i]: None for i in range(HOLDERS_WANTED)})
    blobs.server = object()
    fetch_version(full, blobs, found, None, 1.0)
    assert len(full.records[holders_key("run", 7)]) == HOLDERS_WANTED  # enough were listed: it did not add itself


def test_a_follower_nobody_refused_asks_the_announcers_first_and_lists_nothing_until_a_refusal(peer_ids):
    """Where the learner's seeding covers every follower, the holders key is neither read nor written; a refusal
    ("seeded": more followers than seeds) brings both back for the next HOLDERS_FIRST_FOR versions."""
    from peer.network.holders import HOLDERS_FIRST_FOR, HolderUse

    swarm = HolderSwarm(RSAPrivateKey(), "run", peer_id="QmMe")
    _holder(swarm, RSAPrivateKey(), "QmH", version=7)
    use = HolderUse()
    blobs = FakeBlobs({"L": None, "QmH": None})
    blobs.server = object()
    swarm.reads = 0
    assert fetch_version(swarm, blobs, Announcement(7, SHA, 1000, ("L",), 1), None, 1.0, use=use) == (b"blob", None)
    assert blobs.calls == [["L"]] and swarm.reads == 0, "the holders key was read though nobody refused"
    assert len(swarm.records[holders_key("run", 7)]) == 1, "listed itself though nobody reads the listing"

    class Seeded(FakeBlobs):  # the learner seeded v8 to two others and names one of them
        def fetch(self, sha, size, order, **kw):
            try:
                return super().fetch(sha, size, order, **kw)
            except BlobUnavailable as e:
                raise BlobUnavailable("nobody", e.reasons, ["QmH"]) from None

    _holder(swarm, RSAPrivateKey(), "QmH", version=8)
    blobs = Seeded({"L": "answered: seeded: blob went to 2 peers already", "QmH": None})
    blobs.server = object()
    got = fetch_version(swarm, blobs, Announcement(8, SHA, 1000, ("L",), 1), None, 1.0, use=use)
    assert got == (b"blob", 1) and blobs.calls[0] == ["L"] and blobs.calls[-1][0] == "QmH"
    assert swarm.reads == 1 and use.refusals == 1 and use.first(8 + HOLDERS_FIRST_FOR)
    assert len(swarm.records[holders_key("run", 8)]) == 2, "refused, it lists itself for the next fetchers"
    _holder(swarm, RSAPrivateKey(), "QmH", version=9)
    blobs = FakeBlobs({"L": None, "QmH": None})
    blobs.server = object()
    assert fetch_version(swarm, blobs, Announcement(9, SHA, 1000, ("L",), 1), None, 1.0, use=use) == (b"blob", 1)
    assert blobs.calls == [["QmH", "L"]] and swarm.reads == 2, "after a refusal the holders come first"
    assert not use.first(9 + HOLDERS_FIRST_FOR) and use.refusals == 1


# --- a real swarm: one announcer, four followers, each a DHT process of its own ---------------------------------


def _held_everywhere(pending: list, version: int, blob: bytes) -> bool:
    """One look at each follower in ``pending`` (swarm, service, follower): what it has ready it takes and holds,
    as a peer does; one that got ``version`` (whose bytes must be ``blob``) leaves ``pending``. True once empty."""
    for item in list(pending):
        ready = item[2].take()
        if ready is not None:
            item[2].mark_held(ready[0].version, ready[0].sha256)
            if ready[0].version == version:
                assert ready[1] == blob
                pending.remove(item)
    return not pending


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
def test_in_a_swarm_the_announcer_sends_each_version_twice_and_the_followers_pass_it_on(tmp_path, n):
    """Four followers: two get each version from the learner, two from them. Two: both from the learner, and the
    holders key is never read nor written (nobody is refused)."""
    import contextlib
    import hashlib

    from peer.network.blobs import BlobService
    from peer.network.swarm import NetworkConfig, join
    from peer.run.adapters import AdapterFollower, announce_adapter

    size = 200_000
    blobs = [os.urandom(size) for _ in range(4)]
    shas = [hashlib.sha256(b).hexdigest() for b in blobs]
    with contextlib.ExitStack() as stack:
        learner = stack.enter_context(join(NetworkConfig.loopback(), "spread"))
        served = stack.enter_context(BlobService(learner.dht, BlobCache(tmp_path / "learner")))
        served.seeding.grace = 60.0  # the bound must not depend on how fast this machine is today
        followers = []
        for i in range(n):
            swarm = stack.enter_context(join(NetworkConfig.loopback(learner.visible_maddrs()), "spread"))
            service = stack.enter_context(BlobService(swarm.dht, BlobCache(tmp_path / f"f{i}")))
            follower = AdapterFollower(swarm, service, 0, interval=0.2, held_sha="")
            stack.callback(follower.stop)
            followers.append((swarm, service, follower.start()))
        for version, blob in enumerate(blobs, start=1):
            parent = shas[version - 2] if version > 1 else "0" * 64
            announce_adapter(learner, served, version, blob, parent)
            reached = functools.partial(_held_everywhere, list(followers), version, blob)
            wait_until(reached, f"v{version} at every follower", 60, interval=0.05)
        assert served.served_bytes <= 2 * size * len(blobs), "the learner sent a version more than twice"
        passed_on = sum(service.served_bytes for _, service, _ in followers)
        assert passed_on >= (n - 2) * size * len(blobs), "the followers did not pass the versions on"
        refusals = [follower.holder_use.refusals for _, _, follower in followers]
        listed = [read_holders(learner, v, shas[v - 1], size) for v in range(1, len(blobs) + 1)]
        if n == 2:
            assert refusals == [0, 0] and listed == [[]] * len(blobs), "holders listed where the seeds reach all"
        else:
            assert sum(refusals) >= 2, "four followers, two seeds: the other two were refused each version"
            assert all(1 <= len(ids) <= HOLDERS_WANTED for ids in listed[1:]), listed
