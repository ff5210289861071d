"""Private swarms: invites the coordinator signs, checked by every peer on every DHT request and blob request.

hivemind has no pre-shared key, so a private swarm is built on what it has: its DHT takes an ``authorizer`` that
signs each outgoing request and response and validates each incoming one (``TokenAuthorizerBase``). Here the access
token a peer presents is its **invite**:

* ``hivegrpo invite`` (or the host at start) signs ``(run id, invite id, name, expiry)`` with the run's *issuer
  key*, an Ed25519 key derived from the coordinator's signing key (so a restarted coordinator with the same
  ``--identity`` issues and recognises the same invites). The token is ``hgi1.`` + base64url: about 200 characters.
* Every peer of a private run is started with one (``--invite``). Its DHT requests carry it and are signed with the
  peer's own RSA key; every other peer checks the invite's signature against the issuer key of its own invite,
  the run, the expiry and the revocation list, and answers nothing to a request that fails — so an uninvited peer
  can neither bootstrap, read the manifest, nor store a record. Blob requests carry it too
  (:class:`~peer.network.blobs.server.BlobServer` checks it: the DHT authorizer does not cover custom handlers).
* Revocation: the coordinator publishes the revoked invite ids, signed by the issuer key, under ``{run}_access``;
  every peer re-reads it (:class:`AccessWatcher`) and refuses those invites from then on. A peer whose own invite
  is revoked is told so and stops. Anyone may write a record there, so the watcher checks every record's
  signature *before* picking the newest list, and refuses one dated more than :data:`MAX_CLOCK_SKEW` ahead of its
  own clock: otherwise one forged (or far-future) record would outrank every later genuine list.

An invite is a bearer credential, like an invite link: whoever holds it may join until it expires or is revoked.
Peers see each other's invites (they travel with every request), so a member can pass one on; revoking that invite
cuts off everyone who uses it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field

import msgpack

from peer.errors import UserError
from peer.log import get_logger
from peer.protocol.keys import check_run_id

logger = get_logger(__name__)

PREFIX = "hgi1."
MAX_INVITE_CHARS = 512
MAX_NAME = 64
MAX_REVOKED = 1024
WATCH_INTERVAL = 10.0
MAX_CLOCK_SKEW = 300.0  # s; a revocation list dated further ahead of this peer's clock is refused


class InviteError(UserError, ValueError):
    """An invite that cannot be used: malformed, forged, for another run, expired or revoked."""


def issuer_key(signing_key):
    """The run's Ed25519 invite key, derived from the coordinator's RSA signing key (hivemind ``RSAPrivateKey``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = hashlib.sha256(b"hivegrpo invite issuer\0" + signing_key.to_bytes()).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def _public_bytes(private) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


issuer_public = _public_bytes  # the issuer's public key (32 bytes), as an AccessRecord names it


def _verify(issuer: bytes, signature: bytes, payload: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(issuer).verify(signature, payload)
        return True
    except (InvalidSignature, ValueError):
        return False


@dataclass(frozen=True)
class Invite:
    run_id: str
    invite_id: str  # 16 hex digits
    name: str
    expires: float  # unix time; 0 = never
    issuer: bytes  # the issuer's Ed25519 public key (32 bytes)
    token: str = field(repr=False)

    def expired(self, now: float | None = None) -> bool:
        return self.expires != 0 and (time.time() if now is None else now) >= self.expires

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.expires))
        until = "never expires" if self.expires == 0 else f"expires {when}"
        return f"invite {self.invite_id} ({self.name or 'unnamed'}) for run {self.run_id}, {until}"


def issue_invite(issuer, run_id: str, name: str = "", expires: float = 0.0) -> Invite:
    """A new invite to ``run_id`` signed by ``issuer`` (an Ed25519 private key); ``expires`` 0 never expires."""
    check_run_id(run_id)
    if len(name) > MAX_NAME:
        raise InviteError(f"an invite's name has at most {MAX_NAME} characters, got {len(name)}")
    if expires < 0:
        raise InviteError("an invite's expiry must be a unix time (or 0 for never)")
    invite_id = secrets.token_hex(8)
    payload = msgpack.packb([1, run_id, invite_id, name, float(expires), _public_bytes(issuer)])
    body = msgpack.packb([payload, issuer.sign(payload)])
    token = PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")
    return Invite(run_id, invite_id, name, float(expires), _public_bytes(issuer), token)


def parse_invite(token: str) -> Invite:
    """The invite in ``token``, its signature checked against the issuer key it names; InviteError if unusable.

    Whether that issuer is *this run's* is for the caller (:meth:`Access.check`) to say.
    """
    what = "ask the swarm's host for a new one (`hivegrpo invite`)"
    if not isinstance(token, str) or not token.startswith(PREFIX) or len(token) > MAX_INVITE_CHARS:
        raise InviteError(f"this is not a hivegrpo invite (one starts with {PREFIX!r}); {what}")
    try:
        raw = token[len(PREFIX) :]
        body = msgpack.unpackb(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        payload, signature = body
        version, run_id, invite_id, name, expires, issuer = msgpack.unpackb(payload)
        ok = (
            version == 1
            and isinstance(run_id, str)
            and isinstance(invite_id, str)
            and len(invite_id) == 16
            and isinstance(name, str)
            and isinstance(expires, float)
            and isinstance(issuer, bytes)
            and len(issuer) == 32
            and isinstance(signature, bytes)
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        ok = False
    if not ok:
        raise InviteError(f"this invite is damaged (cut short or mistyped?); {what}")
    if not _verify(issuer, signature, payload):
        raise InviteError(f"this invite's signature does not verify: it was altered; {what}")
    return Invite(run_id, invite_id, name, expires, issuer, token)


def revocations_payload(run_id: str, revoked: list[str], created: float) -> bytes:
    return msgpack.packb([1, run_id, sorted(revoked), float(created)])


class Access:
    """What one peer of a private run checks: its own invite, the run's issuer, the revoked invite ids."""

    def __init__(self, invite: Invite, run_id: str):
        if invite.run_id != run_id:
            raise InviteError(
                f"this invite is for run {invite.run_id!r}, not {run_id!r}: check --run-id, or ask that run's host"
            )
        if invite.expired():
            raise InviteError(f"this {invite.describe()} has expired; ask the swarm's host for a new one")
        self.invite = invite
        self.run_id = run_id
        self.issuer = invite.issuer
        self.revoked: frozenset[str] = frozenset()
        self._cache: dict[str, Invite | None] = {}

    def check(self, token: str | None) -> str | None:
        """None if ``token`` is a valid invite to this run now, else why not (one sentence)."""
        if not token:
            return "no invite: this swarm is private"
        if token not in self._cache:
            try:
                self._cache[token] = parse_invite(token)
            except InviteError:
                self._cache[token] = None
            if len(self._cache) > 4096:
                self._cache.pop(next(iter(self._cache)))
        invite = self._cache[token]
        if invite is None:
            return "the invite is damaged or forged"
        if invite.issuer != self.issuer or invite.run_id != self.run_id:
            return "the invite is for another swarm"
        if invite.expired():
            return f"invite {invite.invite_id} has expired"
        if invite.invite_id in self.revoked:
            return f"invite {invite.invite_id} was revoked"
        return None

    def authorizer(self, signing_key):
        """The hivemind DHT authorizer for this peer (requests signed by ``signing_key``, its RSA key)."""
        return _authorizer_class()(self, signing_key)

    def signed(self, run_id: str, revoked: list[str], created: float, signature: bytes) -> bool:
        """Whether this run's issuer signed this revocation list."""
        return run_id == self.run_id and _verify(self.issuer, signature, revocations_payload(run_id, revoked, created))

    def apply(self, run_id: str, revoked: list[str], created: float, signature: bytes) -> bool:
        """Take a revocation list if the issuer signed it; whether it did."""
        if not self.signed(run_id, revoked, created, signature):
            return False
        self.revoked = frozenset(revoked)
        return True


@functools.cache
def _authorizer_class():
    """hivemind's token protocol with the invite as the token (made on first use: hivemind is heavy to import)."""
    from hivemind.proto.auth_pb2 import AccessToken
    from hivemind.utils.auth import TokenAuthorizerBase
    from hivemind.utils.crypto import RSAPublicKey

    class InviteAuthorizer(TokenAuthorizerBase):
        def __init__(self, access: Access, signing_key):
            super().__init__(signing_key)
            self.access = access

        async def get_token(self) -> AccessToken:
            return AccessToken(
                username=self.access.invite.token,
                public_key=self.local_public_key.to_bytes(),
                expiration_time=str(self.access.invite.expires),
                signature=b"",
            )

        def is_token_valid(self, access_token: AccessToken) -> bool:
            if self.access.check(access_token.username) is not None:
                return False
            try:
                RSAPublicKey.from_bytes(access_token.public_key)
            except Exception:  # not a key: refuse here rather than fail inside hivemind's handler
                return False
            return True

        def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
            return False

    return InviteAuthorizer


async def _apply_in_dht(revoked: list[str], _dht, node) -> None:
    """Runs inside the DHT process: the authorizer there is a copy (the DHT process was forked)."""
    authorizer = node.protocol.authorizer
    if authorizer is not None:
        authorizer.access.revoked = frozenset(revoked)


class AccessWatcher:
    """Re-reads ``{run}_access`` every ``interval`` s; applies a signed revocation list here, in the DHT process and
    to the blob server; calls ``on_revoked(message)`` once if this peer's own invite is revoked."""

    def __init__(self, swarm, on_revoked=None, interval: float = WATCH_INTERVAL):
        self.swarm = swarm
        self.access: Access = swarm.access
        self.on_revoked = on_revoked
        self.interval = interval
        self._stop = threading.Event()
        self._told = False
        self._applied = 0.0  # ``created`` of the list applied last
        self._thread = threading.Thread(target=self._run, name="access-watcher", daemon=True)

    def start(self) -> AccessWatcher:
        self._thread.start()
        return self

    def poll(self) -> bool:
        """Read once; whether a newer revocation list was applied.

        The newest is chosen among the lists the issuer signed and that are not dated in the future (beyond
        :data:`MAX_CLOCK_SKEW`): a record's ``created`` means nothing until its signature is checked.
        """
        from functools import partial

        from peer.protocol import AccessRecord, RecordError, access_key, from_dht_value

        run_id, now = self.swarm.run_id, time.time()
        best, forged, future = None, 0, 0
        for item in self.swarm.get_dict(access_key(run_id)).values():
            try:
                record = from_dht_value(AccessRecord, item.value)
            except (RecordError, ValueError):
                continue
            if record.issuer != self.access.issuer.hex():
                continue
            if not self.access.signed(run_id, list(record.revoked), record.created, bytes.fromhex(record.signature)):
                forged += 1
            elif record.created > now + MAX_CLOCK_SKEW:
                future += 1
            elif best is None or record.created > best.created:
                best = record
        if forged or future:
            logger.warning(
                "ignored %d revocation list(s) whose signature is not the host's and %d dated more than %.0f s "
                "ahead of this peer's clock (if that is the host's, its clock is wrong)",
                forged,
                future,
                MAX_CLOCK_SKEW,
            )
        if best is None or best.created <= self._applied:
            return False
        self.access.revoked = frozenset(best.revoked)  # its signature was checked above
        self._applied = best.created
        self.swarm.dht.run_coroutine(partial(_apply_in_dht, list(best.revoked)))
        own = self.access.invite
        if own.invite_id in self.access.revoked and not self._told:
            self._told = True
            message = f"the swarm's host revoked this peer's {own.describe()}; ask the host for a new invite"
            logger.error(message)
            if self.on_revoked is not None:
                self.on_revoked(message)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # the network boundary: try again next round
                logger.warning("could not read the run's revocation list: %s", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)


def sign_revocations(issuer, run_id: str, revoked: list[str], created: float) -> bytes:
    return issuer.sign(revocations_payload(run_id, revoked, created))


__all__ = [
    "Access",
    "AccessWatcher",
    "Invite",
    "InviteError",
    "issue_invite",
    "issuer_key",
    "issuer_public",
    "parse_invite",
    "sign_revocations",
]
