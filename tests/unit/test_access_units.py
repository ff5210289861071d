"""Invites, the access check every private peer runs, revocation lists and the host's invite book (no network)."""

import base64
import logging
import time

import msgpack
import pytest
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from coordinator.invites import InviteBook, parse_duration
from peer.errors import UserError
from peer.network.access import (
    PREFIX,
    Access,
    InviteError,
    issue_invite,
    issuer_key,
    parse_invite,
    sign_revocations,
)
from peer.network.blobs.wire import BlobRequest, ProtocolError

HOST = RSAPrivateKey()
ISSUER = issuer_key(HOST)


def test_an_invite_round_trips_and_is_short_enough_to_paste():
    invite = issue_invite(ISSUER, "run-a", "alice", expires=time.time() + 60)
    back = parse_invite(invite.token)
    assert (back.run_id, back.invite_id, back.name) == ("run-a", invite.invite_id, "alice")
    assert back.expires == invite.expires and back.issuer == invite.issuer
    assert invite.token.startswith(PREFIX) and len(invite.token) < 300
    assert issuer_key(HOST).private_bytes_raw() == ISSUER.private_bytes_raw(), "the same host key, the same issuer"
    assert issue_invite(ISSUER, "run-a").invite_id != invite.invite_id


def _repack(token: str, change) -> str:
    raw = token[len(PREFIX) :]
    payload, signature = msgpack.unpackb(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    fields = msgpack.unpackb(payload)
    payload, signature = change(fields, payload, signature)
    return PREFIX + base64.urlsafe_b64encode(msgpack.packb([payload, signature])).decode().rstrip("=")


def test_altered_cut_or_foreign_tokens_are_refused_with_a_sentence_saying_so():
    token = issue_invite(ISSUER, "run-a", "bob").token
    longer = _repack(token, lambda f, p, s: (msgpack.packb([*f[:4], f[4] + 3600.0, f[5]]), s))
    with pytest.raises(InviteError, match="altered"):
        parse_invite(longer)
    with pytest.raises(InviteError, match="damaged"):
        parse_invite(token[:-20])
    with pytest.raises(InviteError, match="not a hivegrpo invite"):
        parse_invite("hello" + token)
    with pytest.raises(InviteError, match="damaged"):
        parse_invite(PREFIX + "!!!!")
    assert issubclass(InviteError, UserError), "the CLI prints it as one Error: line"


def test_access_checks_issuer_run_expiry_and_revocation():
    mine = Access(parse_invite(issue_invite(ISSUER, "run-a", "me").token), "run-a")
    other = issue_invite(ISSUER, "run-a", "other")
    assert mine.check(other.token) is None
    assert "private" in mine.check(None) and "private" in mine.check("")
    assert "damaged or forged" in mine.check(other.token[:-8])
    forger = issue_invite(issuer_key(RSAPrivateKey()), "run-a", "forger")
    assert "another swarm" in mine.check(forger.token)
    assert "another swarm" in mine.check(issue_invite(ISSUER, "run-b").token)
    assert "expired" in mine.check(issue_invite(ISSUER, "run-a", expires=time.time() - 1).token)

    created = time.time()
    signature = sign_revocations(ISSUER, "run-a", [other.invite_id], created)
    assert not mine.apply("run-a", [other.invite_id], created, b"x" * 64), "an unsigned list changes nothing"
    assert not mine.apply("run-a", [], created, signature), "nor a signed list with its ids changed"
    assert mine.check(other.token) is None
    assert mine.apply("run-a", [other.invite_id], created, signature)
    assert "revoked" in mine.check(other.token)


def test_a_peer_refuses_its_own_invite_for_the_wrong_run_or_when_expired():
    with pytest.raises(InviteError, match="for run 'run-a', not 'run-b'"):
        Access(parse_invite(issue_invite(ISSUER, "run-a").token), "run-b")
    with pytest.raises(InviteError, match="expired"):
        Access(parse_invite(issue_invite(ISSUER, "run-a", expires=time.time() - 5).token), "run-a")
    with pytest.raises(InviteError):
        issue_invite(ISSUER, "run-a", "x" * 65)


def test_the_dht_authorizer_takes_valid_invites_with_a_real_key_only():
    me = Access(parse_invite(issue_invite(ISSUER, "run-a").token), "run-a")
    authorizer = me.authorizer(RSAPrivateKey())
    other = issue_invite(ISSUER, "run-a")
    key = RSAPrivateKey().get_public_key().to_bytes()
    assert authorizer.is_token_valid(AccessToken(username=other.token, public_key=key))
    assert not authorizer.is_token_valid(AccessToken(username=other.token, public_key=b"not a key"))
    assert not authorizer.is_token_valid(AccessToken(username="", public_key=key))
    forger = issue_invite(issuer_key(RSAPrivateKey()), "run-a")
    assert not authorizer.is_token_valid(AccessToken(username=forger.token, public_key=key))
    me.revoked = frozenset({other.invite_id})
    assert not authorizer.is_token_valid(AccessToken(username=other.token, public_key=key))


def test_blob_requests_carry_an_invite_of_bounded_size():
    token = issue_invite(ISSUER, "run-a").token
    assert BlobRequest.from_wire(BlobRequest("a" * 64, 0, 10, token).to_wire()).invite == token
    assert BlobRequest.from_wire({"sha256": "a" * 64}).invite is None
    for bad in (7, "x" * 600):
        with pytest.raises(ProtocolError, match="invite"):
            BlobRequest.from_wire({"sha256": "a" * 64, "invite": bad})


def test_the_invite_book_issues_revokes_lists_and_reuses_its_default(tmp_path):
    from peer.network.swarm import load_signing_key

    identity = tmp_path / "host.id"
    with pytest.raises(UserError, match="no coordinator identity"):
        InviteBook(identity, "run-a")
    load_signing_key(str(identity))
    book = InviteBook(identity, "run-a")
    first = book.default_invite()
    alice = book.issue("alice", 3600)
    assert InviteBook(identity, "run-a").default_invite().invite_id == first.invite_id, "reused across restarts"
    assert Access(parse_invite(alice.token), "run-a").check(first.token) is None, "same issuer for both"
    book.revoke(first.invite_id)
    assert book.revoked() == [first.invite_id]
    states = {e["id"]: e["state"] for e in InviteBook(identity, "run-a").entries()}
    assert states == {first.invite_id: "revoked", alice.invite_id: "valid"}
    assert book.default_invite().invite_id not in (first.invite_id, alice.invite_id), "a revoked default is replaced"
    with pytest.raises(UserError, match="no invite 'nope'"):
        book.revoke("nope")
    assert oct(book.path.stat().st_mode & 0o777) == "0o600", "the book holds tokens"
    book.path.write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        InviteBook(identity, "run-a")


def test_learner_credentials_expire_by_default_and_can_be_revoked(tmp_path):
    from coordinator.invites import LEARNER_EXPIRY, RENEW_BEFORE
    from peer.network.swarm import load_signing_key

    identity = tmp_path / "host.id"
    load_signing_key(str(identity))
    book = InviteBook(identity, "run-a")
    default = book.default_learner()
    assert default.certificate.expires == pytest.approx(time.time() + LEARNER_EXPIRY, abs=60), "7 days, not never"
    reused = InviteBook(identity, "run-a").default_learner()
    assert reused.certificate.credential_id == default.certificate.credential_id, "the same across restarts"
    book.revoke(default.certificate.credential_id)
    assert book.revoked() == [default.certificate.credential_id]
    renewed = book.default_learner()
    assert renewed.certificate.credential_id != default.certificate.credential_id, "a revoked default is replaced"
    never = book.issue_learner("default", 0)  # one issued before defaults expired: never
    assert never.certificate.expires == 0
    again = book.default_learner()
    assert again.certificate.credential_id not in (never.certificate.credential_id, default.certificate.credential_id)
    assert again.certificate.expires > time.time() + RENEW_BEFORE, "the host never prints a credential about to end"


def test_durations():
    assert parse_duration("30m") == 1800 and parse_duration("7d") == 7 * 86400 and parse_duration("never") == 0
    assert parse_duration("1.5h") == 5400
    for bad in ("", "7", "0d", "-1h", "1w"):
        with pytest.raises(InviteError):
            parse_duration(bad)


class _Item:
    def __init__(self, value):
        self.value = value


class _FakeSwarm:
    """The two things AccessWatcher uses of a Swarm: get_dict, and the DHT process it forwards revocations to."""

    def __init__(self, access, records):
        self.run_id, self.access, self.records, self.forwarded = "run-a", access, records, []
        self.dht = self

    def get_dict(self, key):
        assert key == "run-a_access"
        return {i: _Item(r) for i, r in enumerate(self.records)}

    def run_coroutine(self, fn):
        self.forwarded.append(fn.args[0])


def test_the_watcher_applies_the_newest_list_the_issuer_signed_and_tells_a_revoked_peer_once():
    from peer.network.access import AccessWatcher
    from peer.protocol import AccessRecord, to_dht_value

    me = issue_invite(ISSUER, "run-a", "me")
    other = issue_invite(ISSUER, "run-a", "other")

    def record(revoked, created, key=ISSUER):
        sig = sign_revocations(key, "run-a", revoked, created).hex()
        return to_dht_value(
            AccessRecord(
                issuer=ISSUER.public_key().public_bytes_raw().hex(), revoked=revoked, created=created, signature=sig
            )
        )

    forged = record([other.invite_id, me.invite_id], 30.0, key=issuer_key(RSAPrivateKey()))
    swarm = _FakeSwarm(Access(parse_invite(me.token), "run-a"), [record([], 10.0), record([other.invite_id], 20.0)])
    told = []
    watcher = AccessWatcher(swarm, on_revoked=told.append)
    assert watcher.poll() and swarm.access.revoked == {other.invite_id} and swarm.forwarded == [[other.invite_id]]
    assert not watcher.poll(), "nothing newer"
    swarm.records.append(forged)
    assert not watcher.poll() and swarm.access.revoked == {other.invite_id}, "a list the issuer did not sign"
    swarm.records.append(record([other.invite_id, me.invite_id], 40.0))
    assert watcher.poll() and len(told) == 1 and "revoked this peer's invite" in told[0]
    swarm.records.append(record([other.invite_id, me.invite_id], 50.0))
    assert watcher.poll() and len(told) == 1, "told once"


def _signed_record(revoked, created, key=ISSUER):
    from peer.protocol import AccessRecord, to_dht_value

    signature = sign_revocations(key, "run-a", revoked, created).hex()
    issuer = ISSUER.public_key().public_bytes_raw().hex()  # a forger claims the host's issuer: only keys differ
    return to_dht_value(AccessRecord(issuer=issuer, revoked=revoked, created=created, signature=signature))


def test_a_forged_list_dated_far_ahead_does_not_block_the_hosts_later_revocations(caplog):
    from peer.network.access import AccessWatcher

    me, other = issue_invite(ISSUER, "run-a", "me"), issue_invite(ISSUER, "run-a", "other")
    now = time.time()
    forged = _signed_record([], now + 10 * 365 * 86400, key=issuer_key(RSAPrivateKey()))
    swarm = _FakeSwarm(Access(parse_invite(me.token), "run-a"), [forged])
    watcher = AccessWatcher(swarm)
    assert not watcher.poll() and swarm.access.revoked == frozenset()
    swarm.records.append(_signed_record([other.invite_id], now))
    caplog.clear()
    assert watcher.poll(), "the host's list, newer than every list it signed, is applied"
    assert swarm.access.revoked == {other.invite_id} and swarm.forwarded == [[other.invite_id]]
    assert "revoked" in swarm.access.check(other.token)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 revocation list(s) whose signature is not the host's" in warnings[0]


def test_a_genuine_list_dated_beyond_the_clock_skew_is_refused():
    from peer.network.access import MAX_CLOCK_SKEW, AccessWatcher

    me, other, third = (issue_invite(ISSUER, "run-a", n) for n in ("me", "other", "third"))
    now = time.time()
    ahead = _signed_record([other.invite_id], now + 86400)
    swarm = _FakeSwarm(Access(parse_invite(me.token), "run-a"), [ahead])
    watcher = AccessWatcher(swarm)
    assert not watcher.poll() and swarm.access.revoked == frozenset() and swarm.forwarded == []
    swarm.records.append(_signed_record([third.invite_id], now))
    assert watcher.poll() and swarm.access.revoked == {third.invite_id}, "a later list still takes effect"
    swarm.records.append(_signed_record([other.invite_id, third.invite_id], now + MAX_CLOCK_SKEW / 2))
    assert watcher.poll() and swarm.access.revoked == {other.invite_id, third.invite_id}, "within the skew: taken"
