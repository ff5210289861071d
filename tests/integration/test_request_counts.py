"""With HIVEGRPO_COUNT_REQUESTS set, a real DHT process counts the requests it sends, under the side-channel
call that caused them (peer.network.request_counts); without it, nothing is written."""

import contextlib
import json
import time

import pytest

from peer.network.request_counts import ENV
from tests.helpers.swarm import know_each_other
from tests.helpers.waiting import wait_until


@pytest.mark.timeout(120)
def test_a_dht_process_counts_the_requests_it_sends_by_the_call_that_caused_them(tmp_path, monkeypatch):
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import bucket_key

    counted = tmp_path / "counts"
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(join(NetworkConfig.loopback(), "run"))  # started without the variable
        monkeypatch.setenv(ENV, str(counted))
        b = stack.enter_context(join(NetworkConfig.loopback(a.visible_maddrs()), "run"))
        wait_until(lambda: know_each_other([a, b]), "the two peers in each other's routing tables", 30)
        for _ in range(3):
            b.get_dict(bucket_key("run", 5), narrow=True)
        path = counted / f"{b.dht.pid}.json"
        wait_until(lambda: path.exists() and _reads(path) >= 3, "b's counts written with its three reads", 10)
        data = json.loads(path.read_text())
        time.sleep(1.5)
    assert data["counts"]["call:_get_latest:bucket_N"] >= 3
    assert data["counts"].get("out:call_find<_get_latest:bucket_N", 0) >= 3, data["counts"]
    assert "join" not in data["parent"] and data["parent"], "its parent's command line: this test's"
    assert [p.name for p in counted.glob("*.json")] == [path.name], "a's DHT process, started before, counts nothing"


def _reads(path) -> int:
    try:
        return json.loads(path.read_text())["counts"].get("call:_get_latest:bucket_N", 0)
    except (OSError, ValueError):
        return 0
