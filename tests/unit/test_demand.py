"""The learner's demand in its adapter announcements (protocol 4): the record, its bounds, the run's DHT validator,
and which announcement's demand a follower reads."""

import math
from types import SimpleNamespace

import msgpack
import pydantic.v1 as pydantic
import pytest
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from peer.network.blobs.cache import BlobCache
from peer.protocol import (
    PROTOCOL_VERSION,
    AdapterRecord,
    Demand,
    RecordError,
    adapter_key,
    from_dht_value,
    owner_subkey,
    to_dht_value,
)
from peer.protocol.limits import MAX_ANCESTORS, MAX_DHT_VALUE_BYTES, MAX_INT, MAX_PEER_ID_CHARS, MAX_PROVIDERS
from peer.run.adapters import AdapterFollower, Announcement, announce_adapter, newest_announcement
from tests.helpers.dict_swarm import DictSwarm
from tests.helpers.signing import composite, record, signed

PEER_A = "12D3KooWQxzDHbPHdvWj5HXFfMVFtN1VbGNMW2GfRhDKVo2RFhdT"
PEER_B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
PEER_C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
SHA_X, SHA_Y, SHA_Z = "a" * 64, "b" * 64, "c" * 64
RUN = "run-demand"
KEY = RSAPrivateKey()
PUB = KEY.get_public_key().to_bytes()
DEMAND = Demand(groups_per_second=2.5, waiting=12, contributors=3)


def adapter(demand=None, **fields) -> AdapterRecord:
    values = dict(
        version=3,
        sha256=SHA_X,
        parent_sha256=SHA_Y,
        ancestors=[SHA_Y],
        size=1000,
        providers=[PEER_A],
        created=5.0,
        learner=PEER_A,
        demand=demand,
    )
    values.update(fields)
    return AdapterRecord(**values)


# ---------------------------------------------------------------------------------------------------- the record


def test_a_learner_that_has_not_measured_its_demand_announces_none(tmp_path):
    """Protocol 4 added the demand; an announcement made before the learner measured one says so (None)."""
    swarm = DictSwarm(KEY, RUN, peer_id=PEER_A)
    made = announce_adapter(swarm, SimpleNamespace(cache=BlobCache(tmp_path)), 1, b"adapter v1", SHA_Y)
    [stored] = swarm.records[adapter_key(RUN)].values()
    read = from_dht_value(AdapterRecord, stored)
    assert read == made and read.demand is None, "not yet measured"
    assert read.protocol_version == PROTOCOL_VERSION >= 4


@pytest.mark.parametrize("demand", [None, DEMAND, Demand(groups_per_second=0.0, waiting=0, contributors=0)])
def test_an_announcement_round_trips_with_or_without_demand(demand):
    a = adapter(demand)
    value = to_dht_value(a)
    assert value["demand"] == (None if demand is None else demand.dict())
    assert from_dht_value(AdapterRecord, value) == a
    wire = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)
    parsed = from_dht_value(AdapterRecord, wire)
    assert parsed == a and parsed.demand == demand


def test_the_largest_demand_fits_the_largest_announcement():
    big = Demand(groups_per_second=1e6, waiting=MAX_INT, contributors=1_000_000)
    ids = [f"Qm{'z' * (MAX_PEER_ID_CHARS - 3)}{'123456789ABCDEFGHJKLMNPQRSTUVWXYZ'[i]}" for i in range(MAX_PROVIDERS)]
    ancestors = [f"{i:064x}" for i in range(1, MAX_ANCESTORS + 1)]
    worst = adapter(
        big, version=MAX_INT, parent_sha256=ancestors[0], ancestors=ancestors, providers=ids, learner=ids[0]
    )
    value = to_dht_value(worst)  # raises RecordTooLarge over the DHT's limit
    assert len(MSGPackSerializer.dumps(value)) < MAX_DHT_VALUE_BYTES
    assert from_dht_value(AdapterRecord, value).demand == big


GOOD = {"groups_per_second": 2.5, "waiting": 12, "contributors": 3}
BAD_DEMANDS = {
    "negative rate": {**GOOD, "groups_per_second": -0.5},
    "nan rate": {**GOOD, "groups_per_second": math.nan},
    "inf rate": {**GOOD, "groups_per_second": math.inf},
    "rate over 1e6": {**GOOD, "groups_per_second": 1e6 + 1.0},
    "int rate": {**GOOD, "groups_per_second": 2},
    "string rate": {**GOOD, "groups_per_second": "2.5"},
    "negative waiting": {**GOOD, "waiting": -1},
    "bool waiting": {**GOOD, "waiting": True},
    "float waiting": {**GOOD, "waiting": 12.0},
    "negative contributors": {**GOOD, "contributors": -1},
    "bool contributors": {**GOOD, "contributors": False},
    "too many contributors": {**GOOD, "contributors": 1_000_001},
    "extra field": {**GOOD, "priority": 1},
    "missing field": {"groups_per_second": 2.5, "waiting": 12},
    "not a map": [2.5, 12, 3],
    "a number": 2.5,
}


@pytest.mark.parametrize("case", sorted(BAD_DEMANDS))
def test_a_bad_demand_read_from_the_dht_is_refused(case):
    value = {**to_dht_value(adapter(DEMAND)), "demand": BAD_DEMANDS[case]}
    with pytest.raises(RecordError, match=r"demand"):
        from_dht_value(AdapterRecord, value)


@pytest.mark.parametrize("case", sorted(k for k, v in BAD_DEMANDS.items() if isinstance(v, dict)))
def test_a_bad_demand_cannot_be_built(case):
    with pytest.raises(pydantic.ValidationError):
        Demand(**BAD_DEMANDS[case])


def test_an_announcement_without_the_demand_field_is_refused_as_every_field_is_required():
    value = to_dht_value(adapter(DEMAND))
    del value["demand"]
    with pytest.raises(RecordError):
        from_dht_value(AdapterRecord, value)


def test_an_announcement_of_the_previous_protocol_is_refused():
    value = {**to_dht_value(adapter()), "protocol_version": 3}
    with pytest.raises(RecordError, match="upgrade|version"):
        from_dht_value(AdapterRecord, value)


def test_the_runs_dht_validator_takes_a_good_demand_and_refuses_a_bad_one():
    validator = composite(KEY, RUN)

    def stored(value) -> bool:
        return validator.validate(signed(validator, record(adapter_key(RUN), owner_subkey(PUB), value)))

    assert stored(to_dht_value(adapter(DEMAND)))
    assert stored(to_dht_value(adapter(None)))
    good = to_dht_value(adapter(DEMAND))
    for case in ("negative rate", "int rate", "bool waiting", "extra field", "rate over 1e6"):
        assert not stored({**good, "demand": BAD_DEMANDS[case]}), case


# ---------------------------------------------------------------------------------------------------- the follower


def announced(version, sha, *, created, demand=None, learner=PEER_A, providers=None, parent=SHA_Z):
    rec = AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256="" if version == 0 else parent,
        ancestors=[] if version == 0 else [parent],
        size=1000,
        providers=providers or [learner],
        created=created,
        learner=learner,
        demand=demand,
    )
    return (b"ssh-rsa " + learner.encode(), rec)


def test_the_announcement_carries_the_demand_of_the_leaders_record():
    leader = Demand(groups_per_second=4.0, waiting=8, contributors=2)
    records = [
        announced(5, SHA_X, created=1.0, demand=leader, learner=PEER_A),
        announced(5, SHA_X, created=2.0, demand=None, learner=PEER_B),  # a helper serving the same bytes, later
    ]
    assert newest_announcement(records).demand == leader, "a helper's None must not hide the leader's demand"
    assert newest_announcement(list(reversed(records))).demand == leader


def test_of_several_measured_announcers_the_latest_created_demand_counts():
    old, new = (Demand(groups_per_second=float(g), waiting=1, contributors=1) for g in (1, 9))
    records = [
        announced(5, SHA_X, created=7.0, demand=new, learner=PEER_B),
        announced(5, SHA_X, created=3.0, demand=old, learner=PEER_A),
        announced(5, SHA_X, created=9.0, demand=None, learner=PEER_C),
    ]
    found = newest_announcement(records)
    assert found.demand == new and found.announcers == 3 and found.created == 3.0


def test_only_the_chosen_versions_and_bytes_announcers_give_the_demand():
    other = Demand(groups_per_second=100.0, waiting=0, contributors=1)
    records = [
        announced(6, SHA_X, created=1.0, learner=PEER_A),  # the newest version: not measured yet
        announced(5, SHA_Y, created=9.0, demand=other, learner=PEER_B),  # an older version
    ]
    found = newest_announcement(records)
    assert (found.version, found.demand) == (6, None)
    records = [
        announced(5, SHA_X, created=1.0, learner=PEER_A),
        announced(5, SHA_X, created=2.0, learner=PEER_B),
        announced(5, SHA_Y, created=3.0, demand=other, learner=PEER_C),  # other bytes, fewer announcers
    ]
    found = newest_announcement(records)
    assert (found.sha256, found.demand) == (SHA_X, None)


def test_an_announcement_without_demand_compares_as_before():
    found = newest_announcement([announced(3, SHA_X, created=5.0)])
    assert found == Announcement(3, SHA_X, 1000, (PEER_A,), 1, SHA_Z, 5.0) and found.demand is None


class Swarm:
    """The adapter announcements as a DHT read hands them over."""

    run_id = RUN

    def __init__(self, records):
        self.records = records

    def get_dict(self, key):
        assert key == adapter_key(RUN)
        return {owner_subkey(k): SimpleNamespace(value=to_dht_value(r)) for k, r in self.records}


def test_the_follower_keeps_the_newest_announcements_demand_even_with_no_version_to_fetch():
    demand = Demand(groups_per_second=3.0, waiting=4, contributors=2)
    swarm = Swarm([(PUB, announced(5, SHA_X, created=1.0, demand=demand)[1])])
    follower = AdapterFollower(swarm, blobs=None, held_version=5)  # holds v5 already: nothing to fetch
    assert follower.demand is None
    follower.poll()
    assert follower.demand == demand and follower.take() is None
    swarm.records = [(PUB, announced(5, SHA_X, created=1.0)[1])]  # the learner has not measured (yet, again)
    follower.poll()
    assert follower.demand is None
