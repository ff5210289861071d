"""Counting a DHT process's requests by kind (peer.network.request_counts) and merging the counts of a swarm's
processes (tests.benchmarks.requests): the pure parts."""

import json
from functools import partial

from hivemind.utils.serializer import MSGPackSerializer

from peer.network import request_counts
from peer.network.request_counts import kind_of, tag_call
from tests.benchmarks.requests import merge, outgoing


async def _store_file(path, *args):
    return path


async def _get_latest(key, narrow):
    return key


async def _wait_local(keys, since, timeout):
    return keys


def test_a_key_kind_drops_the_run_and_the_numbers():
    assert kind_of("demo_bucket_12") == "bucket_N"
    assert kind_of("my_run_holders_3") == "run_holders_N", "a run id is taken to end at its first underscore"
    assert kind_of("demo_adapter") == "adapter"


def test_a_call_is_tagged_by_its_function_and_the_kinds_of_its_keys(tmp_path):
    spool = tmp_path / "1-2-3.msgpack"
    spool.write_bytes(MSGPackSerializer.dumps([["demo_holders_4", b"s", 1, 2.0], ["demo_peers", b"t", 1, 2.0]]))
    before = dict(request_counts._counts)
    tag_call(partial(_store_file, str(spool), True, True, (), 2))
    assert request_counts._tag.get() == "_store_file:holders_N,peers"
    tag_call(partial(_get_latest, "demo_bucket_7", {}))
    assert request_counts._tag.get() == "_get_latest:bucket_N"
    tag_call(partial(_wait_local, {"demo_bucket_1": (), "demo_bucket_2": ()}, -1, 1.0))
    assert request_counts._tag.get() == "_wait_local:bucket_N"
    tag_call(partial(_store_file, str(tmp_path / "gone.msgpack")))
    assert request_counts._tag.get() == "_store_file:?", "a spool file that cannot be read is still counted"
    after = request_counts._counts
    assert after["call:_store_file:holders_N,peers"] == before.get("call:_store_file:holders_N,peers", 0) + 1
    assert after["call:_get_latest:bucket_N"] == before.get("call:_get_latest:bucket_N", 0) + 1


def test_the_counts_are_merged_under_each_peers_role_numbered_by_process_id(tmp_path):
    def write(pid, parent, counts, name=None):
        data = {"pid": pid, "parent": parent, "counts": counts} | ({"parent_name": name} if name else {})
        (tmp_path / f"{pid}.json").write_text(json.dumps(data))

    join = ["python", "-m", "peer.demo.prestart", "/t/info.json", "180", "peer.cli", "join", "--json"]
    write(30, join, {"out:call_store<_store_file:bucket_N": 5, "out:call_find<hivemind": 1, "call:_store_file": 2})
    write(20, join, {"out:call_store<_store_file:bucket_N": 7})
    write(40, ["python", "-m", "peer.cli", "host", "--run-id", "x"], {"out:call_ping<hivemind": 3})
    write(45, ["hivegrpo", "demo", "--json"], {"out:call_ping<hivemind": 4}, name="hivegrpo-learn")  # demo-forked
    (tmp_path / ".50.json.tmp").write_text("{half")
    merged = merge(tmp_path)
    assert list(merged) == ["rollout 1", "rollout 2", "host", "learner 1"]
    assert merged["rollout 1"] == {"out:call_store<_store_file:bucket_N": 7}, "the lower process id is rollout 1"
    assert outgoing(merged["rollout 2"]) == 6, "side-channel calls are not requests to other nodes"
