"""What a restarted host rejoins through (coordinator.host.rejoin_addresses): only admitted learners' own
addresses, so a stranger's heartbeat cannot point the host at a swarm of its own."""

from coordinator.host import KNOWN_PEERS, rejoin_addresses

ME = "QmHost"


def _peer(peer_id, role="learner", state="running", maddrs=None):
    return {
        "peer_id": peer_id,
        "role": role,
        "state": state,
        "maddrs": maddrs or [f"/ip4/1.2.3.4/tcp/1/p2p/{peer_id}"],
    }


def test_only_live_learners_addresses_naming_their_own_peer_id_are_kept():
    status = {
        "peers": [
            _peer("QmLearner", maddrs=["/ip4/1.2.3.4/tcp/1/p2p/QmLearner", "/ip4/6.6.6.6/tcp/1/p2p/QmEvil"]),
            _peer("QmRollout", role="rollout"),  # a stranger: rollout heartbeats are anyone's
            _peer("QmGone", state="leaving"),
            _peer(ME),  # its own old heartbeat
        ]
    }
    assert rejoin_addresses(status, ME) == ["/ip4/1.2.3.4/tcp/1/p2p/QmLearner"]


def test_at_most_known_peers_are_kept():
    status = {"peers": [_peer(f"QmL{i}") for i in range(3 * KNOWN_PEERS)]}
    assert len(rejoin_addresses(status, ME)) == KNOWN_PEERS
