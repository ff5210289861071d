"""Learner credentials and admission (peer.network.admission): who may write a run's lineage.

Real RSA and Ed25519 keys throughout; the swarm is a small in-memory stand-in whose ``get_dict`` returns records the
way hivemind does (subkey -> item with ``.value``): choosing among records is pure logic.
"""

import time

import pytest

from peer.network import admission
from peer.network.admission import Admitted, CredentialError
from peer.protocol import (
    AdapterRecord,
    LearnerRecord,
    adapter_key,
    from_dht_value,
    learners_key,
    owner_subkey,
    parse_owner_subkey,
    to_dht_value,
)
from peer.run.adapters import announcements, newest_announcement
from tests.helpers.dict_swarm import DictSwarm, public, run_keys

RUN = "adm"
SHA = [f"{i:064x}" for i in range(1, 20)]


def _Swarm(key, peer_id="QmSelf") -> DictSwarm:
    return DictSwarm(key, RUN, peer_id)


@pytest.fixture(scope="module")
def keys():
    return run_keys()


_pub = public


def _admit(swarm, credential, signer_key, peer_id):
    """Store what a learner with ``signer_key`` and ``peer_id`` publishes with ``credential``."""
    learner = _Swarm(signer_key, peer_id)
    record = admission.learner_record(credential, learner)
    swarm.records.setdefault(learners_key(RUN), {})[owner_subkey(_pub(signer_key))] = to_dht_value(record)


def _announce(swarm, signer_key, version, sha, learner, parent="", size=100):
    record = AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256=parent if version else "",
        ancestors=[parent] if version else [],
        size=size,
        providers=[learner],
        created=time.time(),
        learner=learner,
    )
    swarm.records.setdefault(adapter_key(RUN), {})[owner_subkey(_pub(signer_key))] = to_dht_value(record)


def test_a_credential_round_trips_and_its_certificate_verifies_only_against_its_coordinator(keys):
    credential = admission.issue_credential(keys.host, RUN, "gpu-box", time.time() + 3600)
    parsed = admission.parse_credential(credential.token)
    assert parsed.certificate == credential.certificate and parsed.secret == credential.secret
    assert len(credential.token) < admission.MAX_TOKEN_CHARS
    certificate = admission.verify_certificate(parsed.certificate.raw, _pub(keys.host), RUN)
    assert certificate.name == "gpu-box"
    with pytest.raises(CredentialError, match="not signed by this run's coordinator"):
        admission.verify_certificate(parsed.certificate.raw, _pub(keys.stranger), RUN)
    with pytest.raises(CredentialError, match="for run 'adm', not 'other'"):
        admission.verify_certificate(parsed.certificate.raw, _pub(keys.host), "other")


def test_expired_damaged_and_mismatched_credentials_are_refused_with_a_reason(keys):
    old = admission.issue_credential(keys.host, RUN, expires=time.time() - 1)
    with pytest.raises(CredentialError, match="expired"):
        admission.verify_certificate(old.certificate.raw, _pub(keys.host), RUN)
    good = admission.issue_credential(keys.host, RUN)
    with pytest.raises(CredentialError, match="damaged"):
        admission.parse_credential(good.token[:-40])
    with pytest.raises(CredentialError, match="not a hivegrpo learner credential"):
        admission.parse_credential("hgi1.an-invite-not-a-credential")
    other = admission.issue_credential(keys.host, RUN)
    swapped = admission.Credential(good.certificate, other.secret).token  # someone else's secret
    with pytest.raises(CredentialError, match="secret does not match"):
        admission.parse_credential(swapped)
    forged = bytearray(good.certificate.raw)
    forged[20] ^= 1  # a byte of the payload (the run id or the id): the signature no longer covers it
    with pytest.raises(CredentialError):
        admission.verify_certificate(bytes(forged), _pub(keys.host), RUN)


def test_only_admitted_learners_bound_to_their_peer_id_are_admitted(keys):
    swarm = _Swarm(keys.host)
    credential = admission.issue_credential(keys.host, RUN)
    _admit(swarm, credential, keys.learner, "QmLearner")
    # a stranger copies the learner's public record (certificate + binding) under its own key: the binding names the
    # learner's key, not the stranger's
    copied = swarm.records[learners_key(RUN)][owner_subkey(_pub(keys.learner))]
    swarm.records[learners_key(RUN)][owner_subkey(_pub(keys.stranger))] = copied
    admitted = Admitted(swarm, _pub(keys.host))
    assert set(admitted.learners()) == {_pub(keys.learner)}
    assert admitted.admits(_pub(keys.learner), "QmLearner")
    assert not admitted.admits(_pub(keys.learner), "QmOther"), "the binding names one peer id"
    assert not admitted.admits(_pub(keys.stranger), "QmLearner")
    assert admitted.peer_ids() == {"QmLearner"}
    assert any("binding" in why for why in admitted.refused.values())


def test_a_credential_of_another_coordinator_admits_nobody(keys):
    swarm = _Swarm(keys.host)
    rogue = admission.issue_credential(keys.stranger, RUN)  # a stranger acting as its own coordinator
    _admit(swarm, rogue, keys.stranger, "QmStranger")
    admitted = Admitted(swarm, _pub(keys.host))
    assert admitted.learners() == {} and not admitted.admits_peer("QmStranger")
    assert "not signed by this run's coordinator" in next(iter(admitted.refused.values()))


def test_announcements_count_only_from_admitted_learners_and_the_coordinators_v0(keys):
    swarm = _Swarm(keys.host)
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLearner")
    _announce(swarm, keys.host, 0, SHA[0], "QmHost")
    _announce(swarm, keys.learner, 5, SHA[5], "QmLearner", SHA[4])
    _announce(swarm, keys.stranger, 1005, SHA[9], "QmStranger", SHA[8])  # the takeover the issue describes
    admitted = Admitted(swarm, _pub(keys.host), SHA[0])
    assert newest_announcement(announcements(swarm)).version == 1005, "unfiltered, the stranger would win"
    found = newest_announcement(announcements(swarm, admitted))
    assert (found.version, found.sha256) == (5, SHA[5])
    assert sorted(r.version for _, r in announcements(swarm, admitted)) == [0, 5]
    assert any("v1005" in why for why in admitted.refused.values()), "status can name what was refused"
    # the coordinator's key may announce v0 (and only the manifest's v0), nothing later
    _announce(swarm, keys.host, 7, SHA[7], "QmHost", SHA[6])
    assert sorted(r.version for _, r in announcements(swarm, admitted)) == [5]


def test_an_admitted_key_cannot_announce_for_another_peer(keys):
    swarm = _Swarm(keys.host)
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLearner")
    _announce(swarm, keys.learner, 3, SHA[3], "QmSomeoneEse", SHA[2])
    admitted = Admitted(swarm, _pub(keys.host), SHA[0])
    assert announcements(swarm, admitted) == []


def test_a_learner_admitted_after_the_last_read_is_found_and_reads_stay_rate_limited(keys):
    swarm = _Swarm(keys.host)
    admitted = Admitted(swarm, _pub(keys.host), refresh=60.0)
    assert admitted.learners() == {}
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLate")
    reads = swarm.reads
    assert not admitted.admits_peer("QmLate"), "read under a second ago: not read again"
    assert swarm.reads == reads
    admitted._read_at -= 1.5
    assert admitted.admits_peer("QmLate"), "an unknown peer makes it read again (at most once a second)"
    for _ in range(50):
        admitted.admits_peer("QmNobody")
    assert swarm.reads <= reads + 2


def test_a_learner_record_fits_the_dht_and_its_schema(keys):
    from peer.protocol import MAX_DHT_VALUE_BYTES, from_dht_value, pack

    credential = admission.issue_credential(keys.host, RUN, "x" * admission.MAX_NAME)
    record = admission.learner_record(credential, _Swarm(keys.learner, "Qm" + "z" * 50))
    assert len(pack(record)) < MAX_DHT_VALUE_BYTES // 16, "the longest name and peer id: a small record"
    assert from_dht_value(LearnerRecord, to_dht_value(record)) == record
    with pytest.raises(ValueError):
        LearnerRecord(peer_id="QmX", certificate=b"", binding=b"\0" * 64, created=0.0)


def test_pushes_go_only_to_learners_whose_heartbeat_signer_is_admitted(keys):
    from peer.network.heartbeat import Reachable
    from peer.protocol import PeerRecord, core_peers_key

    swarm = _Swarm(keys.host)
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLearner")
    now = time.time()
    for key, peer_id in ((keys.learner, "QmLearner"), (keys.stranger, "QmFake")):
        beat = PeerRecord(
            peer_id=peer_id,
            role="learner",
            adapter_version=3,
            throughput=0.0,
            hardware="x",
            reachable=True,
            maddrs=[],
            started=now,
            last_seen=now,
            state="running",
            stats={},
        )
        swarm.records.setdefault(core_peers_key(RUN), {})[owner_subkey(_pub(key))] = to_dht_value(beat)
    assert set(Reachable(swarm, "learner")()) == {"QmLearner", "QmFake"}, "a heartbeat alone is a claim"
    assert Reachable(swarm, "learner", admitted=Admitted(swarm, _pub(keys.host)))() == ("QmLearner",)


def test_a_version_whose_blob_does_not_load_is_refused_once_and_never_fetched_again(keys, tmp_path):
    from peer.run.adapters import AdapterFollower

    swarm = _Swarm(keys.host)
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLearner")
    _announce(swarm, keys.learner, 4, SHA[4], "QmLearner", SHA[3])
    fetched = []

    class Blobs:  # serves the announced bytes (junk: what an admitted learner's bug could announce)
        def fetch(self, sha, size, providers, **_):
            fetched.append(sha)
            (tmp_path / sha).write_bytes(b"junk")
            return tmp_path / sha

    follower = AdapterFollower(
        swarm, Blobs(), 3, admitted=Admitted(swarm, _pub(keys.host)), check=lambda blob: "is not valid safetensors"
    )
    follower.poll()
    assert follower.take() is None and SHA[4] in follower.refused and fetched == [SHA[4]]
    follower.poll()
    assert fetched == [SHA[4]], "a refused version is not fetched again"
    _announce(swarm, keys.learner, 5, SHA[5], "QmLearner", SHA[4])
    follower.check = lambda blob: None
    follower.poll()
    assert follower.take()[0].version == 5, "the next good version is taken"


def test_an_adapter_whose_size_is_not_the_runs_is_refused_before_any_fetch(keys):
    swarm = _Swarm(keys.host)
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLearner")
    _announce(swarm, keys.learner, 3, SHA[3], "QmLearner", SHA[2])  # size 100
    admitted = Admitted(swarm, _pub(keys.host), SHA[0])
    admitted.adapter_size = 100
    assert [r.version for _, r in announcements(swarm, admitted)] == [3]
    admitted.adapter_size = 29680  # the bundled model's r=8 adapter, say: a 100-byte claim cannot be it
    assert announcements(swarm, admitted) == []
    assert any("100 bytes" in why for why in admitted.refused.values())


def _record(version, sha, ancestors, learner="QmLearner"):
    return AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256=ancestors[0] if ancestors else "",
        ancestors=ancestors,
        size=100,
        providers=[learner],
        created=time.time(),
        learner=learner,
    )


def test_a_descendant_wins_over_a_higher_version_of_another_lineage():
    from peer.run.adapters import descends

    ours = _record(6, SHA[6], [SHA[5], SHA[4], SHA[3]])  # continues v3 = SHA[3], held here
    theirs = _record(9, SHA[9], [SHA[8], SHA[7], SHA[12], SHA[11], SHA[10], SHA[14]])  # its v3 is not SHA[3]
    assert descends(ours, 3, SHA[3]) is True and descends(theirs, 3, SHA[3]) is False
    assert descends(_record(20, SHA[13], [SHA[14]]), 3, SHA[3]) is None, "too far ahead to tell"
    records = [(b"a", ours), (b"b", theirs)]
    assert newest_announcement(records).version == 9, "without what it holds, a peer takes the highest"
    assert newest_announcement(records, held=(3, SHA[3])).sha256 == SHA[6]
    # the held lineage abandoned by every announcer (a fork resolved among the learners): the newest is followed
    assert newest_announcement([(b"b", theirs)], held=(3, SHA[3])).sha256 == SHA[9]


def test_a_learner_announces_the_ancestors_of_its_lineage():
    from peer.roles.learner.io import Announcer

    announcer = Announcer.__new__(Announcer)
    announcer.lineage = lambda: {0: SHA[0], 1: SHA[1], 2: SHA[2], 3: SHA[3]}
    assert announcer._ancestors(4, SHA[3]) == [SHA[3], SHA[2], SHA[1], SHA[0]]
    assert announcer._ancestors(4, SHA[9]) == [SHA[9]], "a parent its lineage does not hold: only the parent"
    assert announcer._ancestors(0, "") == []


def _publish_revoked(swarm, signer_key, revoked, created=None, run=RUN):
    """What ``hivegrpo host`` stores under ``{run}_access`` (its own subkey, which the DHT's signature validator
    lets only its key write): ``revoked`` ids signed by the issuer key of ``signer_key``."""
    from peer.network.access import issuer_key, issuer_public, sign_revocations
    from peer.protocol import AccessRecord, access_key

    issuer = issuer_key(signer_key)
    created = time.time() if created is None else created
    record = AccessRecord(
        issuer=issuer_public(issuer).hex(),
        revoked=list(revoked),
        created=created,
        signature=sign_revocations(issuer, run, list(revoked), created).hex(),
    )
    swarm.records.setdefault(access_key(run), {})[owner_subkey(_pub(signer_key))] = to_dht_value(record)


def test_a_credential_the_host_revokes_admits_nobody_from_the_next_read(keys):
    swarm = _Swarm(keys.host)
    credential, other = admission.issue_credential(keys.host, RUN), admission.issue_credential(keys.host, RUN)
    _admit(swarm, credential, keys.learner, "QmLearner")
    _admit(swarm, other, keys.stranger, "QmSecond")
    admitted = Admitted(swarm, _pub(keys.host), refresh=0.0)
    assert set(admitted.learners()) == {_pub(keys.learner), _pub(keys.stranger)}
    _announce(swarm, keys.learner, 3, SHA[3], "QmLearner", SHA[2])
    assert [r.version for _, r in announcements(swarm, admitted)] == [3]
    _publish_revoked(swarm, keys.host, [credential.certificate.credential_id])
    assert set(admitted.learners()) == {_pub(keys.stranger)}, "revoked: gone at the next read, the other stays"
    assert announcements(swarm, admitted) == [], "its announcements are ignored"
    assert not admitted.admits(_pub(keys.learner), "QmLearner")
    assert any("was revoked by the host" in why for why in admitted.refused.values())


def test_only_the_coordinators_own_signed_revocation_list_counts(keys):
    swarm = _Swarm(keys.host)
    credential = admission.issue_credential(keys.host, RUN)
    _admit(swarm, credential, keys.learner, "QmLearner")
    revoked = [credential.certificate.credential_id]
    _publish_revoked(swarm, keys.stranger, revoked)  # a stranger's list, under its own subkey, signed by its issuer
    admitted = Admitted(swarm, _pub(keys.host), refresh=0.0)
    assert set(admitted.learners()) == {_pub(keys.learner)}, "a stranger cannot revoke the run's learners"
    _publish_revoked(swarm, keys.host, revoked, created=time.time() + 3600)
    assert set(admitted.learners()) == {_pub(keys.learner)}, "a list dated an hour ahead is refused"
    _publish_revoked(swarm, keys.host, [])
    assert set(admitted.learners()) == {_pub(keys.learner)}
    _publish_revoked(swarm, keys.host, revoked, created=time.time() - 60)  # a replay of an older list
    assert set(admitted.learners()) == {_pub(keys.learner)}
    assert admitted.revoked == frozenset(), "an older list never replaces a newer one"


def _bind_in(records, credential, key, peer_id, run="run-s", created=None):
    learner = _Swarm(key, peer_id)
    learner.run_id = run
    record = admission.learner_record(credential, learner)
    if created is not None:
        record = record.copy(update={"created": created})
    records[owner_subkey(_pub(key))] = to_dht_value(record)


def test_a_credential_bound_to_two_live_keys_admits_neither_and_status_says_so(keys):
    from peer.status import summarize
    from tests.helpers.status import status_manifest

    swarm = _Swarm(keys.host)
    swarm.run_id = "run-s"  # the status units' run
    credential = admission.issue_credential(keys.host, "run-s")
    records = swarm.records.setdefault(learners_key("run-s"), {})
    for key, peer_id in ((keys.learner, "QmLearner"), (keys.stranger, "QmThief")):  # the thief binds it to its key
        _bind_in(records, credential, key, peer_id)
    _announce(swarm, keys.stranger, 1, SHA[1], "QmThief", parent=SHA[0])
    admitted = Admitted(swarm, _pub(keys.host), refresh=0.0)
    assert admitted.learners() == {}, "a stolen copy stops the lineage it could write, for the thief too"
    assert admitted.shared == {credential.certificate.credential_id: 2}
    assert announcements(swarm, admitted) == [], "the thief's announcement is ignored"
    assert not admitted.admits(_pub(keys.stranger), "QmThief") and not admitted.admits(_pub(keys.learner), "QmLearner")
    assert any("2 live keys at once" in why for why in admitted.refused.values())
    learners = [(parse_owner_subkey(k), from_dht_value(LearnerRecord, v)) for k, v in records.items()]
    manifests = [(_pub(keys.host), status_manifest())]
    status = summarize("run-s", [], [], [], manifests, learners=learners)
    assert any("bound to 2 live keys at once" in p and "--revoke" in p for p in status["problems"]), status["problems"]
    refused = {r["fingerprint"] for r in status["refused"]}
    assert {admission.key_fingerprint(_pub(k)) for k in (keys.learner, keys.stranger)} <= refused
    # one of them stopped a while ago (its record is no longer re-stored): the other is admitted
    _bind_in(records, credential, keys.stranger, "QmThief", created=time.time() - 2 * admission.LIVE_BINDING)
    later = Admitted(swarm, _pub(keys.host), refresh=0.0)
    assert set(later.learners()) == {_pub(keys.learner)}
    assert later.shared == {}


def test_a_learner_restarted_under_a_new_key_replaces_its_old_binding(keys):
    swarm = _Swarm(keys.host)
    credential = admission.issue_credential(keys.host, RUN)
    records = swarm.records.setdefault(learners_key(RUN), {})
    _bind_in(records, credential, keys.learner, "QmPrev", run=RUN, created=time.time() - admission.LIVE_BINDING - 5)
    admitted = Admitted(swarm, _pub(keys.host), refresh=0.0)
    assert set(admitted.learners()) == {_pub(keys.learner)}, "alone, a record stored a while ago still admits"
    _bind_in(records, credential, keys.stranger, "QmNext", run=RUN)  # the restart: a new key, the old record lives on
    assert set(admitted.learners()) == {_pub(keys.stranger)}
    assert admitted.shared == {}
    assert any("now bound to another key" in why for why in admitted.refused.values())


def test_one_credential_admits_one_key_by_the_records_dates():
    now = 1_000_000.0
    live, stale = now - 1, now - admission.LIVE_BINDING - 1
    kept, refused, shared = admission.one_per_credential([(b"a", "c1", stale), (b"b", "c2", stale)], now)
    assert kept == {b"a", b"b"} and not refused and not shared, "one key per credential: both admitted"
    kept, refused, shared = admission.one_per_credential([(b"a", "c", live), (b"b", "c", now + 3600)], now)
    assert kept == set() and set(refused) == {b"a", b"b"} and shared == {"c": 2}, "dated ahead is live, not newer"
    kept, _, shared = admission.one_per_credential([(b"a", "c", stale - 10), (b"b", "c", stale)], now)
    assert kept == {b"b"} and not shared, "none live: the newest record counts"
    kept, refused, _ = admission.one_per_credential([(b"a", "c", stale), (b"b", "c", live)], now)
    assert kept == {b"b"} and "now bound to another key" in refused[b"a"]


def test_status_refuses_a_learner_whose_credential_the_host_revoked(keys):
    from peer.protocol import access_key
    from peer.status import summarize
    from tests.helpers.status import NOW, status_manifest

    swarm = _Swarm(keys.host)
    credential = admission.issue_credential(keys.host, "run-s")
    learner = _Swarm(keys.learner, "QmLearner")
    learner.run_id = "run-s"
    record = admission.learner_record(credential, learner)
    _publish_revoked(swarm, keys.host, [credential.certificate.credential_id], run="run-s")
    access = swarm.get_dict(access_key("run-s"))
    manifests = [(_pub(keys.host), status_manifest())]
    args = dict(now=NOW, learners=[(_pub(keys.learner), record)])
    assert not summarize("run-s", [], [], [], manifests, **args)["refused"], "admitted without the list"
    refused = summarize("run-s", [], [], [], manifests, access=access, **args)["refused"]
    assert [r["why"] for r in refused] == [
        f"learner record refused: its learner credential {credential.certificate.credential_id} was revoked by the "
        "host"
    ]


def test_thousands_of_strangers_announcing_log_a_bounded_number_of_lines(keys, caplog):
    """The review's M3: 3,000 strangers' announcements logged 3,000 warnings at every read."""
    import logging

    swarm = _Swarm(keys.host)
    records = swarm.records.setdefault(adapter_key(RUN), {})
    fakes = [b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7/stranger%d==" % i for i in range(3000)]
    template = AdapterRecord(
        version=7, sha256=SHA[7], parent_sha256=SHA[6], ancestors=[SHA[6]], size=100, providers=["QmX"],
        created=time.time(), learner="QmX",
    )  # fmt: skip
    for fake in fakes:
        records[owner_subkey(fake)] = to_dht_value(template)
    admitted = Admitted(swarm, _pub(keys.host), refresh=0.0)
    with caplog.at_level(logging.WARNING, logger="hivegrpo.network.admission"):
        for _ in range(3):
            assert announcements(swarm, admitted) == []
    lines = [r for r in caplog.records if r.name == "hivegrpo.network.admission"]
    assert len(lines) <= admission.LOGGED_PER_MINUTE, len(lines)
    assert len(admitted.refused) == admission.MAX_REMEMBERED, "status still names the newest refused"


def test_export_takes_only_announcements_of_the_runs_adapter_size(keys):
    """The review's low finding: export fetched and read whole an admitted announcement of up to 16 GiB."""
    from peer.export import EXPORT_ADAPTER_LIMIT, sized_announcements

    swarm = _Swarm(keys.host)
    _admit(swarm, admission.issue_credential(keys.host, RUN), keys.learner, "QmLearner")
    _announce(swarm, keys.learner, 5, SHA[5], "QmLearner", SHA[4], size=16 << 30)  # a stolen credential's
    admitted = Admitted(swarm, _pub(keys.host), SHA[0], refresh=0.0)
    assert [r.version for _, r in announcements(swarm, admitted)] == [5], "admitted: only its size is wrong"
    assert sized_announcements(announcements(swarm, admitted), admitted, _pub(keys.host)) == [], "over the limit"
    _announce(swarm, keys.host, 0, SHA[0], "QmHost", size=100)  # the coordinator's v0: the run's size
    _announce(swarm, keys.learner, 5, SHA[5], "QmLearner", SHA[4], size=EXPORT_ADAPTER_LIMIT)
    kept = sized_announcements(announcements(swarm, admitted), admitted, _pub(keys.host))
    assert [r.version for _, r in kept] == [0], "v0's size is the run's: another size is ignored"
    _announce(swarm, keys.learner, 5, SHA[5], "QmLearner", SHA[4], size=100)
    kept = sized_announcements(announcements(swarm, admitted), admitted, _pub(keys.host))
    assert sorted(r.version for _, r in kept) == [0, 5]
