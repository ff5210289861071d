"""What a DHT node keeps of a run's keys (peer.network.quota): the rule, on plain dictionaries; pure logic."""

from peer.network.quota import CLOCK_SKEW, MAX_KEY_BYTES, MAX_TTL, KeyQuota
from peer.protocol.keys import group_subkey, owner_subkey

NOW = 1_000_000.0
A, B = b"ssh-rsa AAAAalice", b"ssh-rsa AAAAbob"


def _bucket(entries):
    """{subkey: (value, expiration)} of bucket entries ``(owner, version, seq, size)``."""
    return {group_subkey(o, v, s): (b"x" * n, NOW + 60) for o, v, s, n in entries}


def test_a_record_living_longer_than_its_key_allows_is_not_kept():
    rule = KeyQuota("peers")
    ok = rule.check({}, owner_subkey(A), b"v", NOW + MAX_TTL["peers"] + CLOCK_SKEW, NOW)
    late = rule.check({}, owner_subkey(A), b"v", NOW + MAX_TTL["peers"] + CLOCK_SKEW + 1, NOW)
    assert ok.ok and not late.ok and "ahead" in late.why
    assert KeyQuota("bucket_3").check({}, group_subkey(A, 3, 0), b"v", NOW + 10 * 3600, NOW).ok is False


def test_a_full_key_refuses_newcomers_but_lets_holders_refresh_in_place():
    rule = KeyQuota("manifest", max_bytes=1000)
    held = {owner_subkey(A): (b"m" * 500, NOW + 60), owner_subkey(b"ssh-rsa AAAAcarol"): (b"m" * 400, NOW + 60)}
    assert not rule.check(held, owner_subkey(B), b"m" * 200, NOW + 60, NOW).ok, "a stranger's manifest on top"
    assert rule.check(held, owner_subkey(A), b"n" * 500, NOW + 3600, NOW).ok, "the coordinator's refresh"
    assert not rule.check(held, owner_subkey(A), b"n" * 900, NOW + 60, NOW).ok, "but not a larger one"


def test_one_signer_holds_at_most_its_share_of_a_bucket():
    rule = KeyQuota("bucket_0", per_signer=3)
    held = _bucket([(A, 0, s, 10) for s in range(3)])
    assert not rule.check(held, group_subkey(A, 0, 3), b"x", NOW + 60, NOW).ok
    assert rule.check(held, group_subkey(B, 0, 0), b"x", NOW + 60, NOW).ok
    assert rule.check(held, group_subkey(A, 0, 1), b"y" * 10, NOW + 60, NOW).ok, "its own entry again"


def test_a_full_bucket_drops_its_oldest_versions_for_a_newer_entry_and_never_its_own_version():
    rule = KeyQuota("bucket_0", max_bytes=3000)
    held = _bucket([(A, 0, 0, 900), (B, 64, 0, 900), (A, 128, 0, 900)])
    size = len(group_subkey(B, 192, 0))
    fresh = rule.check(held, group_subkey(B, 192, 0), b"x" * 900, NOW + 60, NOW)
    assert fresh.ok and fresh.evict == (group_subkey(A, 0, 0),), fresh
    flood = rule.check(held, group_subkey(B, 0, 1), b"x" * 900, NOW + 60, NOW)
    assert not flood.ok, "entries of its own version (or newer) are never dropped for it"
    assert size < 200


def test_whatever_1000_signers_write_one_bucket_stays_under_the_message_limit():
    rule = KeyQuota("bucket_5")
    held: dict = {}
    for i in range(1000):
        owner = b"ssh-rsa AAAA" + str(i).encode()
        subkey = group_subkey(owner, 5, 0)
        verdict = rule.check(held, subkey, b"z" * 48_000, NOW + 600, NOW)
        if verdict.ok:
            held[subkey] = (b"z" * 48_000, NOW + 600)
    total = sum(len(k) + len(v) for k, (v, _) in held.items())
    assert total <= rule.max_bytes < 4 << 20 and len(held) < 1000


def _junk(n: int, size: int = 1024) -> dict:
    """What ``n`` strangers' records of ``size`` bytes fill a small key with, expiring in 60-120 s."""
    return {owner_subkey(b"ssh-rsa AAAAjunk%d" % i): (b"j" * size, NOW + 60 + i % 60) for i in range(n)}


def test_in_a_key_full_of_strangers_a_signer_with_standing_evicts_them_and_a_stranger_evicts_nothing():
    """The review's H3: 2,002 junk records of 1 KiB filled the learners', adapter and heartbeat keys for good."""
    standing = {A}.__contains__
    for field in ("learners", "adapter", "core_peers", "credit", "metrics"):
        rule = KeyQuota(field)
        held = _junk(1995)
        assert not rule.check(held, owner_subkey(A), b"a" * 9000, NOW + 60, NOW).ok, "full, without standing"
        new = rule.check(held, owner_subkey(A), b"a" * 9000, NOW + 60, NOW, standing)
        over = sum(len(k) + len(v) for k, (v, _) in held.items()) + len(owner_subkey(A)) + 9000 - MAX_KEY_BYTES
        freed = [len(k) + len(held[k][0]) for k in new.evict]
        assert new.ok and sum(freed) >= over > sum(freed[:-1]), (field, over, freed)  # just enough
        assert all(held[k][1] <= min(held[j][1] for j in held if j not in new.evict) for k in new.evict), "soonest"
        stranger = rule.check(held, owner_subkey(B), b"b" * 900, NOW + 60, NOW, standing)
        assert not stranger.ok and not stranger.evict, "a stranger evicts nothing"
    held = {**_junk(2000), owner_subkey(A): (b"a" * 100, NOW + 60)}
    grown = KeyQuota("adapter").check(held, owner_subkey(A), b"a" * 8000, NOW + 60, NOW, standing)
    assert grown.ok and grown.evict, "a growing announcement makes room for itself"
    assert not KeyQuota("adapter").check(held, owner_subkey(A), b"a" * 8000, NOW + 60, NOW).ok, "without standing"
    assert not KeyQuota("peers").check(_junk(2100), owner_subkey(A), b"a", NOW + 30, NOW, standing).ok, (
        "heartbeats: rollout peers have no standing (docs/reliability.md, open)"
    )


def test_standing_never_evicts_another_signer_with_standing():
    both = {A, B}.__contains__
    held = {owner_subkey(B): (b"b" * 900, NOW + 60)}
    verdict = KeyQuota("learners", max_bytes=1000).check(held, owner_subkey(A), b"a" * 500, NOW + 60, NOW, both)
    assert not verdict.ok and "signers with standing" in verdict.why


def test_a_node_gives_standing_to_a_learner_whose_admission_verifies_and_to_no_one_else():
    import msgpack
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.network import admission
    from peer.network.quota import Standing
    from peer.protocol import to_dht_value
    from tests.helpers.dict_swarm import DictSwarm, public

    host, learner, stranger = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    record = admission.learner_record(admission.issue_credential(host, "q"), DictSwarm(learner, "q", "QmLearner"))
    value = msgpack.packb(to_dht_value(record))
    standing = Standing()
    standing.learner_record("q", public(learner), value)
    assert not standing(public(learner)), "no coordinator key yet: nothing verifies"
    standing.coordinator = public(host)
    standing.learner_record("q", public(stranger), value)  # the learner's record copied under another key
    standing.learner_record("q", public(learner), b"\x93junk")
    standing.learner_record("q", public(learner), value)
    assert standing(public(learner)) and standing(public(host)) and not standing(public(stranger))
    other = Standing()
    other.coordinator = public(stranger)  # a node of another coordinator's run of the same name
    other.learner_record("q", public(learner), value)
    assert not other(public(learner))
