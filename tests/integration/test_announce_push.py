"""Announcements pushed to the followers' own DHT nodes (peer.run.adapters): real peers in real DHT processes on
loopback. A pushed announcement makes a follower read the network at once; a stranger's pushed record is read once
and never followed."""

import contextlib
import time
from types import SimpleNamespace

import pytest

from tests.helpers.swarm import know_each_other
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


class OnlyAdmits:
    """The admission policy's calls a follower makes: only ``key``'s announcements extend the lineage."""

    def __init__(self, key: bytes):
        self.key = key
        self.refused: list[bytes] = []

    def admits_announcement(self, signer: bytes, record) -> str | None:
        return None if signer == self.key else "not an admitted learner of this run"

    def refuse(self, signer: bytes, why: str) -> None:
        self.refused.append(signer)


def test_a_pushed_announcement_wakes_its_follower_and_a_strangers_is_never_followed(tmp_path):
    from peer.network.blobs.cache import BlobCache
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import AdapterRecord, adapter_key, owner_subkey, to_dht_value
    from peer.run.adapters import AdapterFollower, announce_adapter

    with contextlib.ExitStack() as stack:
        first = stack.enter_context(join(NetworkConfig.loopback(), "run"))
        learner, follower_swarm, stranger = (
            stack.enter_context(join(NetworkConfig.loopback(first.visible_maddrs()), "run")) for _ in range(3)
        )
        wait_until(lambda: know_each_other([first, learner, follower_swarm, stranger]), "a routing table each", 30)
        follower = AdapterFollower(follower_swarm, None, held_version=0, admitted=OnlyAdmits(learner.public_key))
        assert not follower.local_newer(), "nothing announced yet"

        fake = AdapterRecord(
            version=7,
            sha256="ab" * 32,
            parent_sha256="cd" * 32,
            ancestors=["cd" * 32],
            size=3,
            providers=[str(stranger.peer_id)],
            created=time.time(),
            learner=str(stranger.peer_id),
        )
        item = (adapter_key("run"), owner_subkey(stranger.public_key), to_dht_value(fake), time.time() + 60)
        assert stranger.push([item], [str(follower_swarm.peer_id)], "adapter announcement") == 1
        wait_until(lambda: follower_swarm.local_dict(adapter_key("run")), "the stranger's record in the node", 10)
        assert not follower.local_newer(), "signed, stored, but no admitted learner's: never a reason to read"

        blobs = SimpleNamespace(cache=BlobCache(tmp_path / "blobs"))
        announce_adapter(learner, blobs, 1, b"new adapter", "cd" * 32, push_to=[str(follower_swarm.peer_id)])
        wait_until(follower.local_newer, "the learner's pushed announcement seen in the follower's own node", 10)
        assert not follower.local_newer(), "a record is looked at once: the poll it wakes decides"
        assert [(k, r.version) for k, r in follower.records(network=False)] == [(learner.public_key, 1)], (
            "what the woken poll takes: the admitted learner's, not the stranger's newer one"
        )
        assert stranger.public_key in follower.admitted.refused
        network = wait_until(lambda: follower.records(network=True), "the stored announcement, read", 10)
        assert [(k, r.version) for k, r in network] == [(learner.public_key, 1)], "one per signer, the newest"
        announce_adapter(learner, blobs, 2, b"newer adapter", "ef" * 32, push_to=[str(follower_swarm.peer_id)])
        wait_until(follower.local_newer, "the next version, pushed", 10)

        follower.mark_held(5)
        announce_adapter(learner, blobs, 3, b"older than held", "01" * 32, push_to=[str(follower_swarm.peer_id)])
        mine = owner_subkey(learner.public_key)

        def held_v3() -> bool:
            item = follower_swarm.local_dict(adapter_key("run")).get(mine)
            return item is not None and item.value["version"] == 3

        wait_until(held_v3, "version 3 pushed to the follower's node", 10)
        assert not follower.local_newer(), "a version not newer than what the follower holds wakes nothing"
