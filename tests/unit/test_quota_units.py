"""What a DHT node keeps of a run's keys (peer.network.quota): the rule, on plain dictionaries; pure logic."""

from peer.network.quota import CLOCK_SKEW, MAX_TTL, KeyQuota
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
