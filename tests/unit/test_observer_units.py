"""The demo's observer shows the newest metrics that an admitted learner signed about itself: anyone can write the
metrics key, so a stranger's record, one that names another learner, and one that does not parse are skipped."""

from types import SimpleNamespace

from hivemind.utils.crypto import RSAPrivateKey

from peer.demo.observer import newest_metrics
from peer.network.admission import Admission
from peer.protocol import owner_subkey, to_dht_value
from tests.unit.test_status_units import metrics


def test_only_an_admitted_learners_own_metrics_are_shown_the_newest_of_them():
    learner, stranger = (RSAPrivateKey().get_public_key().to_bytes() for _ in range(2))
    admitted = {learner: Admission(learner, "QmLearner", "cred", "learner", 0)}

    def entry(owner: bytes, value) -> tuple[bytes, SimpleNamespace]:
        return owner_subkey(owner), SimpleNamespace(value=value)

    found = dict([entry(learner, to_dht_value(metrics(7)))])
    assert newest_metrics(found, admitted).version == 7
    found = dict(
        [
            entry(learner, to_dht_value(metrics(7))),
            entry(stranger, to_dht_value(metrics(900))),  # not admitted
        ]
    )
    assert newest_metrics(found, admitted).version == 7
    assert newest_metrics(found, {}) is None, "nobody admitted: nothing is shown"
    claims_another = dict([entry(learner, to_dht_value(metrics(9, learner="QmAnotherPeer")))])
    assert newest_metrics(claims_another, admitted) is None, "an admitted key speaking for another peer id"
    junk = dict([entry(learner, b"\x00junk"), (b"not a subkey", SimpleNamespace(value=to_dht_value(metrics(8))))])
    assert newest_metrics(junk, admitted) is None
