"""The run's DHT validators: first record by record, then on two real hivemind DHTs on loopback."""

import dataclasses
import functools
import pickle

import pydantic.v1 as pydantic
import pytest
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from peer.protocol import keys
from peer.protocol.limits import BUCKET_RING
from peer.protocol.records import BucketEntry, MetricsRecord, PeerRecord, from_dht_value, groups_of, to_dht_value
from peer.protocol.validators import GroupSubkey, OwnerSubkey, RunSchema, make_validators
from peer.protocol.version import PROTOCOL_VERSION
from tests.helpers.records import make_group, make_heartbeat, make_metrics
from tests.helpers.signing import KEY_A, KEY_B, PUB_A, PUB_B, RUN, composite, forge, record, signed
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------------- offline


def test_schema_covers_exactly_the_key_builders():
    schema = make_validators(RUN, KEY_A)[1]
    expected = {DHTID.generate(source=keys.field_key(RUN, name)).to_bytes(): name for name in keys.schema_fields()}
    assert schema._key_id_to_field_name == expected
    assert DHTID.generate(source=keys.bucket_key(RUN, 70)).to_bytes() in expected
    assert set(RunSchema.__fields__) == set(keys.schema_fields())
    assert keys.OWNER_PREFIX + b"_key_" + keys.OWNER_SUFFIX == RSASignatureValidator.PUBLIC_KEY_FORMAT


def test_our_subkeys_are_owner_signed_subkeys_to_hivemind():
    validate = pydantic.create_model("Probe", b=(BytesWithPublicKey, ...), o=(OwnerSubkey, ...), g=(GroupSubkey, ...))
    validate(b=keys.group_subkey(PUB_A, 1, 2), o=keys.owner_subkey(PUB_A), g=keys.group_subkey(PUB_A, 1, 2))
    assert RSASignatureValidator(KEY_A).local_public_key == keys.owner_subkey(PUB_A)


def test_valid_records_pass():
    validator = composite()
    entry = BucketEntry.of_group(make_group(version=3, seq=4))
    assert validator.validate(
        signed(validator, record(keys.peers_key(RUN), keys.owner_subkey(PUB_A), to_dht_value(make_heartbeat())))
    )
    assert validator.validate(
        signed(validator, record(keys.metrics_key(RUN), keys.owner_subkey(PUB_A), to_dht_value(make_metrics())))
    )
    good = record(keys.bucket_key(RUN, 3), keys.group_subkey(PUB_A, 3, 4), to_dht_value(entry))
    assert validator.validate(signed(validator, good))
    # another peer's validator accepts it too: only the signature matters, not who checks it
    assert composite(KEY_B).validate(signed(validator, good))


def test_an_accepted_record_is_not_parsed_again_and_a_refused_one_always_is(monkeypatch):
    validator = composite()
    schema = next(v for v in validator._validators if isinstance(v, SchemaValidator))
    parses = []
    real = RunSchema.parse_obj.__func__
    monkeypatch.setattr(RunSchema, "parse_obj", classmethod(lambda cls, obj: parses.append(1) or real(cls, obj)))

    def entry(slot: int, seq: int) -> DHTRecord:  # group 3.seq in bucket slot ``slot``
        value = to_dht_value(BucketEntry.of_group(make_group(version=3, seq=seq)))
        return signed(validator, record(keys.bucket_key(RUN, slot), keys.group_subkey(PUB_A, 3, seq), value))

    good, wrong_slot, other = entry(3, 4), entry(4, 4), entry(3, 5)
    assert validator.validate(good) and validator.validate(good) and len(parses) == 1, "remembered"
    assert not validator.validate(wrong_slot) and not validator.validate(wrong_slot) and len(parses) == 3
    assert validator.validate(other) and len(parses) == 4, "a different record is parsed"
    assert len(pickle.loads(pickle.dumps(schema))._accepted) == 2, "what it remembered travels to the DHT process"


def test_an_accepted_signature_is_not_verified_again_and_no_other_record_passes_for_it(monkeypatch):
    from hivemind.utils.crypto import RSAPublicKey

    validator = composite()
    verifies = []
    real = RSAPublicKey.verify
    monkeypatch.setattr(RSAPublicKey, "verify", lambda self, data, sig: verifies.append(1) or real(self, data, sig))
    value = to_dht_value(BucketEntry.of_group(make_group(version=3, seq=4)))
    good = signed(validator, record(keys.bucket_key(RUN, 3), keys.group_subkey(PUB_A, 3, 4), value))
    assert validator.validate(good) and validator.validate(good) and len(verifies) == 1, "remembered"
    later = dataclasses.replace(good, expiration_time=good.expiration_time + 60)
    assert not validator.validate(later) and not validator.validate(later) and len(verifies) == 3, (
        "a longer life is not what was signed: verified, refused, each time"
    )
    forged = forge(record(keys.bucket_key(RUN, 3), keys.group_subkey(PUB_A, 3, 4), value), KEY_B)
    assert not validator.validate(forged) and len(verifies) == 4, "signed by another key than its subkey names"
    moved = dataclasses.replace(good, subkey=good.subkey + good.value[:1], value=good.value[1:])
    assert not validator.validate(moved), "the same bytes split otherwise between subkey and value are another record"


@pytest.mark.parametrize(
    "case",
    [
        "wrong slot",
        "subkey version differs",
        "subkey seq differs",
        "heartbeat in a bucket",
        "entry under owner subkey",
        "heartbeat under group subkey",
        "subkey without owner",
        "plain value under run key",
        "unknown key",
        "other run",
        "extra field",
        "int for float",
        "newer protocol",
    ],
)
def test_bad_records_are_refused(case):
    validator = composite()
    entry = to_dht_value(BucketEntry.of_group(make_group(version=3, seq=4)))
    beat = to_dht_value(make_heartbeat())
    own, slot3 = keys.owner_subkey(PUB_A), keys.bucket_key(RUN, 3)
    rec = {
        "wrong slot": lambda: record(keys.bucket_key(RUN, 4), keys.group_subkey(PUB_A, 3, 4), entry),
        "subkey version differs": lambda: record(keys.bucket_key(RUN, 67), keys.group_subkey(PUB_A, 67, 4), entry),
        "subkey seq differs": lambda: record(slot3, keys.group_subkey(PUB_A, 3, 5), entry),
        "heartbeat in a bucket": lambda: record(slot3, keys.group_subkey(PUB_A, 3, 4), beat),
        "entry under owner subkey": lambda: record(slot3, own, entry),
        "heartbeat under group subkey": lambda: record(keys.peers_key(RUN), keys.group_subkey(PUB_A, 3, 4), beat),
        "subkey without owner": lambda: record(keys.peers_key(RUN), b"QmPeerA", beat),
        "plain value under run key": lambda: record(keys.peers_key(RUN), None, beat),
        "unknown key": lambda: record(f"{RUN}_elsewhere", own, beat),
        "other run": lambda: record(keys.peers_key("run-w"), own, beat),
        "extra field": lambda: record(keys.peers_key(RUN), own, {**beat, "admin": True}),
        "int for float": lambda: record(keys.peers_key(RUN), own, {**beat, "throughput": 1}),
        "newer protocol": lambda: record(keys.peers_key(RUN), own, {**beat, "protocol_version": PROTOCOL_VERSION + 1}),
    }[case]()
    assert not validator.validate(signed(validator, rec))


def test_only_the_owner_can_sign():
    validator = composite(KEY_B)
    rec = record(keys.peers_key(RUN), keys.owner_subkey(PUB_B), to_dht_value(make_heartbeat(peer_id="QmPeerB")))
    assert validator.validate(signed(validator, rec))
    assert validator.validate(forge(rec, KEY_B)), "forge() must sign like hivemind, or the next checks prove nothing"
    assert not validator.validate(forge(rec, KEY_A)), "a signature by another key was accepted"
    assert not validator.validate(rec), "an unsigned owner record was accepted"
    # A's own validator does not sign a subkey naming B, so A cannot even produce the record
    assert composite(KEY_A).sign_value(rec) == rec.value
    tampered = signed(validator, rec)
    tampered = dataclasses.replace(tampered, value=tampered.value.replace(b"QmPeerB", b"QmPeerC"))
    assert not validator.validate(tampered)
    longer_life = dataclasses.replace(signed(validator, rec), expiration_time=rec.expiration_time + 1)
    assert not validator.validate(longer_life)


def test_validators_survive_pickling_as_hivemind_does():
    """hivemind pickles validators into the DHT process (DHT.add_validators): the copy must validate the same."""
    validator = composite()
    copy = pickle.loads(pickle.dumps(make_validators(RUN, KEY_A)))
    copy = CompositeValidator(copy)
    good = signed(
        validator,
        record(
            keys.bucket_key(RUN, 3),
            keys.group_subkey(PUB_A, 3, 0),
            to_dht_value(BucketEntry.of_group(make_group(version=3, seq=0))),
        ),
    )
    assert copy.validate(good)
    assert not copy.validate(dataclasses.replace(good, key=DHTID.generate(source=keys.bucket_key(RUN, 4)).to_bytes()))


def test_schema_patch_stays_local():
    """SchemaValidator sets ``schema.Config.extra``; without its own config that would be pydantic's global default."""
    before = pydantic.BaseConfig.extra
    make_validators(RUN, KEY_A)
    assert pydantic.BaseConfig.extra == before
    assert RunSchema.__config__.extra == pydantic.Extra.forbid


def test_make_validators_checks_its_arguments():
    with pytest.raises(ValueError, match="invalid run id"):
        make_validators("bad run", KEY_A)
    with pytest.raises(TypeError, match="RSAPrivateKey"):
        make_validators(RUN, b"key")
    assert isinstance(make_validators(RUN, KEY_A)[1], SchemaValidator)


# ---------------------------------------------------------------------------------------------------- real DHTs


@pytest.fixture(scope="module")
def swarm():
    started = []
    try:
        first = DHT(
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            use_relay=False,
            use_auto_relay=False,
            record_validators=make_validators(RUN, KEY_A),
        )
        started.append(first)
        second = DHT(
            start=True,
            initial_peers=[str(addr) for addr in first.get_visible_maddrs()],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            use_relay=False,
            use_auto_relay=False,
            record_validators=make_validators(RUN, KEY_B),
        )
        started.append(second)
        yield first, second
    finally:
        for dht in reversed(started):
            dht.shutdown()


def entries(dht: DHT, key: str) -> dict:
    """``{subkey: (value, expiration)}`` of ``key`` as ``dht`` finds it, or ``{}``."""
    found = dht.get(key, latest=True)
    if found is None:
        return {}
    return {subkey: (item.value, item.expiration_time) for subkey, item in found.value.items()}


def test_a_peer_stores_its_own_signed_records_and_the_other_reads_them(swarm):
    a, b = swarm
    beat = make_heartbeat(peer_id=a.peer_id.to_base58())
    assert a.store(keys.peers_key(RUN), to_dht_value(beat), get_dht_time() + 60, subkey=keys.owner_subkey(PUB_A))
    entry = BucketEntry.of_group(make_group(version=3, seq=1, producer=a.peer_id.to_base58()))
    subkey = keys.group_subkey(PUB_A, 3, 1)
    assert a.store(keys.bucket_key(RUN, 3), to_dht_value(entry), get_dht_time() + 60, subkey=subkey)

    seen = wait_until(lambda: entries(b, keys.peers_key(RUN)).get(keys.owner_subkey(PUB_A)), "A's heartbeat on B", 15)
    assert from_dht_value(PeerRecord, seen[0]) == beat
    seen = wait_until(lambda: entries(b, keys.bucket_key(RUN, 3 + BUCKET_RING)).get(subkey), "A's group on B", 15)
    parsed = from_dht_value(BucketEntry, seen[0])
    group = groups_of(parsed.inline, 3, 1, 1)[0]
    assert parsed == entry and group.completions[1].behaviour_logprobs() == [-1.25, -1.25]


def test_a_bad_record_is_refused_and_never_visible(swarm):
    a, b = swarm
    key, subkey = keys.metrics_key(RUN), keys.owner_subkey(PUB_A)
    bad = {**to_dht_value(make_metrics()), "groups_accepted": 1.0}
    assert not a.store(key, bad, get_dht_time() + 60, subkey=subkey)
    assert not a.store(key, to_dht_value(make_metrics()), get_dht_time() + 60)  # no subkey: not owner-signed
    assert not a.store(f"{RUN}_unlisted", to_dht_value(make_metrics()), get_dht_time() + 60, subkey=subkey)
    wrong_slot = to_dht_value(BucketEntry.of_group(make_group(version=5, seq=0)))
    assert not a.store(keys.bucket_key(RUN, 4), wrong_slot, get_dht_time() + 60, subkey=keys.group_subkey(PUB_A, 5, 0))

    # a good record stored afterwards shows up, so the bad ones' absence is not just a slow read
    good = make_metrics(groups_accepted=7)
    assert a.store(key, to_dht_value(good), get_dht_time() + 30, subkey=subkey)
    seen = wait_until(lambda: entries(b, key).get(subkey), "A's metrics on B", 15)
    assert from_dht_value(MetricsRecord, seen[0]) == good
    assert set(entries(b, key)) == {subkey}
    assert entries(b, f"{RUN}_unlisted") == {} and entries(a, f"{RUN}_unlisted") == {}
    assert keys.group_subkey(PUB_A, 5, 0) not in entries(b, keys.bucket_key(RUN, 4))


async def _store_forged(_dht, node, *, key, subkey, value, expiration_time, signer, peer_id):
    """Run inside A's DHT process: send B a record signed by ``signer``, bypassing A's own validators."""
    rec = record(key, subkey, value, expiration_time)
    store_ok = await node.protocol.call_store(
        PeerID.from_base58(peer_id),
        keys=[DHTID.generate(source=key)],
        values=[forge(rec, signer).value],
        expiration_time=[expiration_time],
        subkeys=[subkey],
    )
    return None if store_ok is None else list(store_ok)  # a protobuf repeated field does not pickle


def test_a_forged_owner_is_refused_and_changes_nothing(swarm):
    a, b = swarm
    key, b_subkey = keys.peers_key(RUN), keys.owner_subkey(PUB_B)
    original = make_heartbeat(peer_id=b.peer_id.to_base58(), role="learner")
    expiration = get_dht_time() + 60
    assert b.store(key, to_dht_value(original), expiration, subkey=b_subkey)
    wait_until(lambda: entries(a, key).get(b_subkey), "B's heartbeat on A", 15)

    forged = to_dht_value(make_heartbeat(peer_id=b.peer_id.to_base58(), role="learner", state="leaving"))
    # through A's own DHT.store: A does not sign a subkey naming B, and every replica refuses the unsigned record
    assert not a.store(key, forged, expiration + 30, subkey=b_subkey)
    # straight to B, signed with A's key as hivemind would sign it: B checks the signature against B's key
    send = functools.partial(
        _store_forged, key=key, value=forged, expiration_time=expiration + 30, peer_id=b.peer_id.to_base58()
    )
    assert a.run_coroutine(functools.partial(send, subkey=b_subkey, signer=KEY_A)) == [False]
    # control: the same path with a subkey A owns is accepted, so the refusal above is the owner check
    a_subkey = keys.owner_subkey(PUB_A)
    forged_own = to_dht_value(make_heartbeat(peer_id=a.peer_id.to_base58(), adapter_version=9))
    control = functools.partial(send, subkey=a_subkey, value=forged_own, signer=KEY_A)
    assert a.run_coroutine(control) == [True]

    for reader in (a, b):
        value, expiration_seen = entries(reader, key)[b_subkey]
        assert from_dht_value(PeerRecord, value) == original
        assert expiration_seen == pytest.approx(expiration)
