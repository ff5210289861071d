"""Who may write a run's lineage: learner credentials, signed by the coordinator, shown by every learner.

Rollout is open in a public swarm; the lineage is not. Anyone can make a DHT key pair, so "the highest version
anyone announces" would let one stranger take a run over. The coordinator decides who learns:

* ``hivegrpo host`` (its own learn line) and ``hivegrpo invite --role learner`` issue a **learner credential**: a
  *certificate* — ``(run id, credential id, name, expiry, holder key)`` signed with the coordinator's RSA signing
  key, the key every peer already pins (it signs the manifest; ``--coordinator`` names its fingerprint) — plus the
  *holder secret*, an Ed25519 private key made for this credential alone, whose public half is the holder key.
  The token is ``hgl1.`` + base64url, about 510 characters; it is a secret like an invite.
* A learner started with one (``--learner-credential``) signs, with the holder secret, a *binding* of the
  certificate to its own DHT signing key and its libp2p peer id, and publishes both under ``{run}_learners`` in
  its own owner subkey (:class:`~peer.protocol.LearnerRecord`, re-stored with its heartbeat).
* Every peer (:class:`Admitted`) takes an adapter announcement, a learner heartbeat (for pushes) or a team call
  only from a signer whose record there verifies: certificate signed by this run's coordinator, for this run, not
  expired, and bound to that very signer and peer id. The coordinator's own key is admitted for v0 alone.

The certificate is public (it travels in the record); copying it gains nothing without the holder secret, which
never leaves the learner. Why a delegation and not a list the coordinator keeps: learners can be admitted while
the host is down (``hivegrpo invite`` works offline), and nothing on the hot path waits for the coordinator.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgpack

from peer.errors import UserError
from peer.log import get_logger
from peer.protocol.keys import check_run_id, key_fingerprint

logger = get_logger(__name__)

PREFIX = "hgl1."
MAX_TOKEN_CHARS = 1024
MAX_NAME = 64
FORMAT = 1
REFRESH = 5.0  # s between reads of the learners' records
RECORD_TTL = 120.0  # s a learner's record lives unless re-stored (it is, with every heartbeat)
MAX_REMEMBERED = 256  # signers whose refusal reason is kept for status
LOGGED_PER_MINUTE = 10  # signers whose refusal is logged a minute (the rest are counted in one line)
LIVE_BINDING = 30.0  # s: a binding re-stored within this is live (a learner re-stores its record every 10 s)


class CredentialError(UserError, ValueError):
    """A learner credential that cannot be used: malformed, forged, for another run or coordinator, expired."""


@dataclass(frozen=True)
class Certificate:
    """What the coordinator signed for one learner credential."""

    run_id: str
    credential_id: str  # 16 hex digits
    name: str
    expires: float  # unix time; 0 = never
    holder: bytes  # the Ed25519 public key the credential's secret belongs to (32 bytes)
    raw: bytes  # packed [payload, signature]: what a LearnerRecord carries

    def expired(self, now: float | None = None) -> bool:
        return self.expires != 0 and (time.time() if now is None else now) >= self.expires


@dataclass(frozen=True)
class Credential:
    """A learner's credential: the certificate and the holder secret (32 bytes, the Ed25519 seed)."""

    certificate: Certificate
    secret: bytes

    @property
    def token(self) -> str:
        body = msgpack.packb([self.certificate.raw, self.secret])
        return PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")


def _payload(run_id: str, credential_id: str, name: str, expires: float, holder: bytes) -> bytes:
    return msgpack.packb([FORMAT, "learner", run_id, credential_id, name, float(expires), holder])


def _holder_key(secret: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(secret)


def _public_bytes(private) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def issue_credential(signing_key, run_id: str, name: str = "", expires: float = 0.0) -> Credential:
    """A new learner credential for ``run_id``, signed by the coordinator's ``signing_key`` (hivemind RSA key)."""
    check_run_id(run_id)
    if len(name) > MAX_NAME:
        raise CredentialError(f"a credential's name has at most {MAX_NAME} characters, got {len(name)}")
    if expires < 0:
        raise CredentialError("a credential's expiry must be a unix time (or 0 for never)")
    secret = secrets.token_bytes(32)
    holder = _public_bytes(_holder_key(secret))
    credential_id = secrets.token_hex(8)
    payload = _payload(run_id, credential_id, name, expires, holder)
    signature = base64.b64decode(signing_key.sign(payload))  # hivemind's RSA-PSS/SHA-256, base64
    raw = msgpack.packb([payload, signature])
    return Credential(Certificate(run_id, credential_id, name, float(expires), holder, raw), secret)


def read_certificate(raw: bytes) -> Certificate:
    """The certificate packed in ``raw``, its fields checked (its signature: :func:`verify_certificate`)."""
    try:
        payload, signature = msgpack.unpackb(raw, max_bin_len=1024, max_str_len=256, max_array_len=8)
        fmt, role, run_id, credential_id, name, expires, holder = msgpack.unpackb(
            payload, max_bin_len=64, max_str_len=128, max_array_len=8
        )
        ok = (
            fmt == FORMAT
            and role == "learner"
            and isinstance(run_id, str)
            and isinstance(credential_id, str)
            and len(credential_id) == 16
            and isinstance(name, str)
            and len(name) <= MAX_NAME
            and isinstance(expires, float)
            and isinstance(holder, bytes)
            and len(holder) == 32
            and isinstance(signature, bytes)
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        ok = False
    if not ok:
        raise CredentialError("the learner certificate is damaged or not a hivegrpo certificate")
    return Certificate(run_id, credential_id, name, expires, holder, raw)


def verify_certificate(raw: bytes, coordinator_key: bytes, run_id: str, now: float | None = None) -> Certificate:
    """The certificate in ``raw`` if ``coordinator_key`` (OpenSSH RSA public key) signed it for ``run_id`` and it
    has not expired; :class:`CredentialError` saying which check failed otherwise."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

    certificate = read_certificate(raw)
    payload, signature = msgpack.unpackb(raw)
    try:
        key = serialization.load_ssh_public_key(coordinator_key)
        key.verify(
            signature,
            payload,
            padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH),
            hashes.SHA256(),
        )
    except (InvalidSignature, ValueError, TypeError, AttributeError) as e:  # not RSA, not a key, not its signature
        raise CredentialError(
            f"the learner certificate was not signed by this run's coordinator {key_fingerprint(coordinator_key)}"
        ) from e
    if certificate.run_id != run_id:
        raise CredentialError(f"the learner certificate is for run {certificate.run_id!r}, not {run_id!r}")
    if certificate.expired(now):
        raise CredentialError(f"learner credential {certificate.credential_id} has expired")
    return certificate


def parse_credential(token: str) -> Credential:
    """The credential in ``token`` (its structure and that the secret matches the holder key); whose signature the
    certificate carries is checked against the run's coordinator by :func:`verify_certificate`."""
    what = "ask the swarm's host for a new one (`hivegrpo invite --role learner`)"
    if not isinstance(token, str) or not token.startswith(PREFIX) or len(token) > MAX_TOKEN_CHARS:
        raise CredentialError(f"this is not a hivegrpo learner credential (one starts with {PREFIX!r}); {what}")
    try:
        raw = token[len(PREFIX) :]
        body = msgpack.unpackb(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)), max_bin_len=1024)
        certificate_raw, secret = body
        if not isinstance(certificate_raw, bytes) or not isinstance(secret, bytes) or len(secret) != 32:
            raise ValueError("bad fields")
        certificate = read_certificate(certificate_raw)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise CredentialError(f"this learner credential is damaged (cut short or mistyped?); {what}") from e
    if _public_bytes(_holder_key(secret)) != certificate.holder:
        raise CredentialError(f"this learner credential's secret does not match its certificate; {what}")
    return Credential(certificate, secret)


def binding_payload(run_id: str, signer_key: bytes, peer_id: str) -> bytes:
    """What a credential's holder signs to tie the certificate to one DHT signing key and one libp2p peer id."""
    return msgpack.packb([FORMAT, "bind", run_id, hashlib.sha256(signer_key).digest(), peer_id])


def bind(credential: Credential, run_id: str, signer_key: bytes, peer_id: str) -> bytes:
    return _holder_key(credential.secret).sign(binding_payload(run_id, signer_key, peer_id))


def check_binding(certificate: Certificate, binding: bytes, run_id: str, signer_key: bytes, peer_id: str) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(certificate.holder).verify(
            binding, binding_payload(run_id, signer_key, peer_id)
        )
        return True
    except (InvalidSignature, ValueError):
        return False


def learner_record(credential: Credential, swarm):
    """This learner's :class:`~peer.protocol.LearnerRecord` for ``swarm`` (its run, signing key and peer id)."""
    from peer.protocol import LearnerRecord

    peer_id = str(swarm.peer_id)
    return LearnerRecord(
        peer_id=peer_id,
        certificate=credential.certificate.raw,
        binding=bind(credential, swarm.run_id, swarm.public_key, peer_id),
        created=time.time(),
    )


def publish_admission(swarm, credential: Credential, ttl: float = RECORD_TTL) -> bool:
    """Store this learner's admission under ``{run}_learners`` (its own owner subkey); whether a node took it."""
    from peer.protocol import learners_key, owner_subkey, to_dht_value

    record = learner_record(credential, swarm)
    return swarm.store(
        learners_key(swarm.run_id),
        owner_subkey(swarm.public_key),
        to_dht_value(record),
        time.time() + ttl,
        "admission",
    )


def keep_admitted(swarm, heartbeat, credential: Credential) -> bool:
    """Publish this learner's admission and re-store it with every beat of ``heartbeat``; whether a node took it."""
    heartbeat.also.append(lambda: publish_admission(swarm, credential))
    return publish_admission(swarm, credential)


@dataclass(frozen=True)
class Admission:
    """A learner the coordinator admitted, as this peer verified it."""

    signer: bytes  # its DHT signing key (OpenSSH RSA public key)
    peer_id: str
    credential_id: str
    name: str
    expires: float  # 0 = never

    def expired(self, now: float) -> bool:
        return self.expires != 0 and now >= self.expires


def read_revoked(items: dict, run_id: str, coordinator_key: bytes) -> tuple[frozenset[str], float] | None:
    """The revoked ids and their list's ``created`` in ``items`` (a read of ``{run}_access``), from the record under
    the coordinator's own subkey — the DHT's signature validator lets only its key write there, so the issuer key
    that record names is the coordinator's — if the issuer signed it and it is not dated more than
    :data:`~peer.network.access.MAX_CLOCK_SKEW` ahead; else None."""
    from peer.network.access import MAX_CLOCK_SKEW, _verify, revocations_payload
    from peer.protocol import AccessRecord, RecordError, from_dht_value, owner_subkey

    item = items.get(owner_subkey(coordinator_key))
    if item is None:
        return None
    try:
        record = from_dht_value(AccessRecord, item.value)
    except (RecordError, ValueError):
        return None
    payload = revocations_payload(run_id, list(record.revoked), record.created)
    if record.created > time.time() + MAX_CLOCK_SKEW:
        return None
    if not _verify(bytes.fromhex(record.issuer), bytes.fromhex(record.signature), payload):
        return None
    return frozenset(record.revoked), record.created


def one_per_credential(bindings, now: float | None = None) -> tuple[set[bytes], dict[bytes, str], dict[str, int]]:
    """Which of ``bindings`` — ``(signer, credential id, created)`` of verified learner records — count: a credential
    admits one key. Of the keys one credential is bound to, those whose record was stored in the last
    :data:`LIVE_BINDING` s are live: one live key is admitted (a learner restarted under a new key replaces its old
    record within ``LIVE_BINDING`` s); two or more live keys are the same credential on two machines — shared, or
    stolen — and none is admitted until the host revokes it or one stops (a thief gains nothing by binding a copied
    secret while its holder runs: the lineage it could write stops for everyone, and status names the credential).
    With no live key (the learners stalled, or this clock runs ahead) the newest record counts. A record dated ahead
    is live, never older than another: a signer's date moves only its own record.

    Returns the signers admitted, why each other one is not, and credential id -> live keys for those shared."""
    now = time.time() if now is None else now
    by_credential: dict[str, list[tuple[bytes, float]]] = {}
    for signer, credential_id, created in bindings:
        by_credential.setdefault(credential_id, []).append((signer, created))
    kept, refused, shared = set(), {}, {}
    for credential_id, keys in by_credential.items():
        if len(keys) == 1:
            kept.add(keys[0][0])
            continue
        live = [signer for signer, created in keys if created >= now - LIVE_BINDING]
        if len(live) > 1:
            shared[credential_id] = len(live)
            for signer, _ in keys:
                refused[signer] = shared_problem(credential_id, len(live))
            continue
        if not live:
            live = [max((created, signer) for signer, created in keys)[1]]
        kept.update(live)
        for signer, _ in keys:
            if signer not in live:
                refused[signer] = (
                    f"its learner credential {credential_id} is now bound to another key (a newer record)"
                )
    return kept, refused, shared


def shared_problem(credential_id: str, signers: int) -> str:
    return (
        f"learner credential {credential_id} is bound to {signers} live keys at once, so none of them is admitted: "
        f"give each learner its own (`hivegrpo host --learners N`, `hivegrpo invite --role learner`), and if one of "
        f"them is not yours, revoke it (`hivegrpo invite --revoke {credential_id}`)"
    )


class Admitted:
    """The run's admitted learners as this peer sees them: ``{run}_learners`` re-read at most every ``refresh``
    seconds, each record verified once (by its bytes). The coordinator's key is admitted for adapter v0 only.

    ``refused`` names, for status, the signers this peer ignored and why (the newest ``MAX_REMEMBERED``).

    A credential is something the host can take back: the coordinator's revocation list (``{run}_access``, under
    the coordinator's own subkey, the ids signed by its invite issuer key; :mod:`coordinator.invites`) is read with
    every refresh, and an admission whose credential id it lists is refused from then on — within ``refresh``
    seconds of the list reaching the DHT. A credential admits one key (:func:`one_per_credential`): ``shared`` names
    those that live records bind to more than one signer (one learn line pasted on several machines, or a copied
    secret), none of whose signers is admitted; logged once, shown by status, so the host can give each learner its
    own and revoke the one that leaked.
    """

    def __init__(self, swarm, coordinator_key: bytes, adapter0_sha256: str = "", *, refresh: float = REFRESH):
        self.swarm = swarm
        self.coordinator_key = coordinator_key
        self.adapter0_sha256 = adapter0_sha256
        self.adapter_size = 0  # bytes every adapter of the run has (its LoRA shape fixes them); 0: not known yet
        self.refresh_every = refresh
        self.refused: OrderedDict[str, str] = OrderedDict()  # signer fingerprint -> why
        self._by_signer: dict[bytes, Admission] = {}  # every verified record's signer, one credential's or not
        self._admitted: dict[bytes, Admission] = {}  # those of them admitted (one key per credential)
        self._seen: dict[bytes, float] = {}  # signer -> when a read last returned its (valid) record
        self._created: dict[bytes, float] = {}  # signer -> its record's ``created`` (when it was last stored)
        self._checked: OrderedDict[bytes, Admission | str] = OrderedDict()  # digest of (signer, value) -> result
        self._read_at = -float("inf")
        self._lock = threading.Lock()
        self.revoked: frozenset[str] = frozenset()  # credential ids the coordinator's signed list revoked
        self._revoked_at = 0.0  # ``created`` of the list applied
        self.shared: dict[str, int] = {}  # credential id -> signers its admissions bind it to, when more than one
        self.on_change = None  # called with the admitted signers (a frozenset) whenever they change
        self._told: frozenset[bytes] = frozenset()
        self._logged_since, self._logged, self._unlogged = -float("inf"), 0, 0  # refusals logged this minute

    # --- reading -------------------------------------------------------------------------------------------------

    def learners(self, force: bool = False) -> dict[bytes, Admission]:
        """Signer key → admission of every learner whose record verifies now."""
        with self._lock:
            now = time.monotonic()
            if force or now - self._read_at >= self.refresh_every:
                self._read_at = now
                try:
                    self._read_revoked()
                    self._merge(self._read(), time.monotonic())
                except Exception as e:  # the network boundary: keep what was known, try again later
                    logger.warning("could not read the run's admitted learners: %s", e)
            return dict(self._admitted)

    def _merge(self, found: dict[bytes, tuple[Admission, float]], now: float) -> None:
        """One read's admissions, plus those read before whose record cannot have expired since: a DHT read can
        miss entries of a dictionary (a node that did not hold them yet), and a learner must not flicker. What was
        revoked since is dropped too."""
        for signer, (admission, created) in found.items():
            self._by_signer[signer], self._seen[signer] = admission, now
            self._created[signer] = max(created, self._created.get(signer, created))
        wall = time.time()
        for signer in list(self._by_signer):
            admission = self._by_signer[signer]
            if admission.credential_id in self.revoked:
                self.refuse(signer, f"its learner credential {admission.credential_id} was revoked by the host")
            elif not (now - self._seen[signer] > RECORD_TTL or admission.expired(wall)):
                continue
            del self._by_signer[signer], self._seen[signer], self._created[signer]
        kept, refused, shared = one_per_credential(
            (signer, a.credential_id, self._created[signer]) for signer, a in self._by_signer.items()
        )
        for credential_id in shared.keys() - self.shared.keys():
            logger.warning(shared_problem(credential_id, shared[credential_id]))
        for signer, why in refused.items():
            self.refuse(signer, why)
        self.shared = shared
        self._admitted = {signer: self._by_signer[signer] for signer in kept}
        if self.on_change is not None and self._admitted.keys() != self._told:
            self._told = frozenset(self._admitted)
            self.on_change(self._told)

    def _read_revoked(self) -> None:
        """Apply the coordinator's revocation list if a newer one is in the DHT (:func:`read_revoked`)."""
        from peer.protocol import access_key

        found = read_revoked(
            self.swarm.get_dict(access_key(self.swarm.run_id)), self.swarm.run_id, self.coordinator_key
        )
        if found is not None and found[1] > self._revoked_at:
            self.revoked, self._revoked_at = found

    def _read(self) -> dict[bytes, tuple[Admission, float]]:
        from peer.protocol import LearnerRecord, RecordError, from_dht_value, learners_key, parse_owner_subkey

        out: dict[bytes, tuple[Admission, float]] = {}
        now = time.time()
        for subkey, item in self.swarm.get_dict(learners_key(self.swarm.run_id)).items():
            try:
                signer, record = parse_owner_subkey(subkey), from_dht_value(LearnerRecord, item.value)
            except (RecordError, ValueError):
                continue  # every peer's validator refuses these on store
            digest = hashlib.sha256(b"\0".join((signer, record.certificate, record.binding, record.peer_id.encode())))
            result = self._checked.get(digest.digest())
            if result is None or (isinstance(result, Admission) and result.expired(now)):
                try:
                    result = self._verify(signer, record, now)
                except CredentialError as e:
                    result = str(e)
                self._checked[digest.digest()] = result
                if len(self._checked) > 4 * MAX_REMEMBERED:
                    self._checked.popitem(last=False)
            if isinstance(result, Admission):
                out[signer] = result, record.created
            else:
                self.refuse(signer, result)
        return out

    def _verify(self, signer: bytes, record, now: float) -> Admission:
        run_id = self.swarm.run_id
        certificate = verify_certificate(record.certificate, self.coordinator_key, run_id, now)
        if not check_binding(certificate, record.binding, run_id, signer, record.peer_id):
            raise CredentialError("the learner record's binding was not signed by its credential's holder")
        return Admission(signer, record.peer_id, certificate.credential_id, certificate.name, certificate.expires)

    def refuse(self, signer: bytes, why: str) -> None:
        """Remember (for status) that ``signer`` was ignored, and why; logged the first time, at most
        ``LOGGED_PER_MINUTE`` signers a minute (then one line counts the rest): thousands of strangers' records under
        a key would otherwise log a warning each at every read."""
        fingerprint = key_fingerprint(signer)
        if fingerprint not in self.refused:
            now = time.monotonic()
            if now - self._logged_since >= 60.0:
                if self._unlogged:
                    logger.warning("ignored %d more signers in the last minute (status lists them)", self._unlogged)
                self._logged_since, self._logged, self._unlogged = now, 0, 0
            if self._logged < LOGGED_PER_MINUTE:
                self._logged += 1
                logger.warning("ignoring signer %s: %s", fingerprint, why)
            else:
                self._unlogged += 1
        self.refused[fingerprint] = why
        self.refused.move_to_end(fingerprint)
        while len(self.refused) > MAX_REMEMBERED:
            self.refused.popitem(last=False)

    # --- questions -----------------------------------------------------------------------------------------------

    def admits(self, signer: bytes, peer_id: str) -> bool:
        """Whether ``signer`` is an admitted learner whose libp2p peer id is ``peer_id``."""
        admission = self.learners().get(signer)
        if admission is None:
            admission = self._retry(signer)
        return admission is not None and admission.peer_id == peer_id

    def admits_peer(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is the libp2p id of an admitted learner (read again, at most once a second, when
        it is not known yet: a learner that just started has just published its admission)."""
        if peer_id in self.peer_ids():
            return True
        with self._lock:
            stale = time.monotonic() - self._read_at >= 1.0
        return stale and peer_id in {a.peer_id for a in self.learners(force=True).values()}

    def peer_ids(self) -> set[str]:
        """The libp2p peer ids of the admitted learners (whom team calls may come from, pushes go to)."""
        return {a.peer_id for a in self.learners().values()}

    def admits_announcement(self, signer: bytes, record) -> str | None:
        """None if ``record`` (an AdapterRecord signed by ``signer``) may extend the lineage, else why not."""
        if signer == self.coordinator_key:
            if record.version == 0 and record.sha256 == self.adapter0_sha256:
                return None
            return "the coordinator's key may announce adapter v0 only"
        admission = self.learners().get(signer) or self._retry(signer)
        if admission is None:
            return "not an admitted learner of this run (no valid learner credential)"
        if admission.peer_id != record.learner:
            return f"announces for peer {record.learner}, but its credential is bound to {admission.peer_id}"
        if self.adapter_size and record.size != self.adapter_size:
            return f"announces an adapter of {record.size} bytes; this run's LoRA shape makes {self.adapter_size}"
        return None

    def _retry(self, signer: bytes) -> Admission | None:
        """A signer not known yet may have been admitted since the last read: read again, at most once a second."""
        with self._lock:
            stale = time.monotonic() - self._read_at >= 1.0
        return self.learners(force=True).get(signer) if stale else None


__all__ = [
    "Admission",
    "Admitted",
    "Certificate",
    "Credential",
    "CredentialError",
    "bind",
    "check_binding",
    "issue_credential",
    "keep_admitted",
    "learner_record",
    "one_per_credential",
    "parse_credential",
    "publish_admission",
    "read_certificate",
    "read_revoked",
    "shared_problem",
    "verify_certificate",
]
