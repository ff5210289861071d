"""DHT records as hivemind builds and signs them, for tests of the run's validators without a network.

Two keys sign: ``KEY_A`` (the peer under test) and ``KEY_B`` (another peer of run ``RUN``).
"""

import dataclasses

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from peer.protocol.validators import make_validators

RUN = "run-v"
KEY_A, KEY_B = RSAPrivateKey(), RSAPrivateKey()
PUB_A, PUB_B = KEY_A.get_public_key().to_bytes(), KEY_B.get_public_key().to_bytes()


def composite(private_key=KEY_A, run=RUN) -> CompositeValidator:
    """The validators a peer holding ``private_key`` runs for ``run``, as its DHT combines them."""
    return CompositeValidator(make_validators(run, private_key))


def record(key: str, subkey, value, expiration: float = 1e10) -> DHTRecord:
    """The record hivemind builds for ``DHT.store(key, value, expiration, subkey=subkey)``, before signing."""
    subkey_bytes = DHTProtocol.IS_REGULAR_VALUE if subkey is None else MSGPackSerializer.dumps(subkey)
    return DHTRecord(DHTID.generate(source=key).to_bytes(), subkey_bytes, MSGPackSerializer.dumps(value), expiration)


def signed(validator: CompositeValidator, rec: DHTRecord) -> DHTRecord:
    """``rec`` as ``validator``'s DHT stores it: signed where its subkey names the validator's own key."""
    return dataclasses.replace(rec, value=validator.sign_value(rec))


def forge(rec: DHTRecord, signer: RSAPrivateKey) -> DHTRecord:
    """``rec`` signed exactly as hivemind signs, but with ``signer`` whatever owner its subkey names."""
    signature = signer.sign(MSGPackSerializer.dumps(dataclasses.astuple(rec)))
    return dataclasses.replace(
        rec, value=rec.value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)
    )
