"""The status summary, its rendering, the web page's series and Prometheus text, from records built here."""

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from prometheus_client.parser import text_string_to_metric_families

from coordinator.web import StatusHistory, WebServer, point_of, prometheus
from peer.protocol import (
    AdapterRecord,
    MetricsRecord,
    PeerRecord,
    PeerTally,
    RecordError,
    key_fingerprint,
    to_dht_value,
)
from peer.protocol.limits import MAX_DHT_VALUE_BYTES, MAX_HISTORY, MAX_TALLIED
from peer.status import SILENT_AFTER, human_bytes, render, sparkline, summarize
from tests.helpers.status import NOW, status_manifest

KEYS = {name: RSAPrivateKey().get_public_key().to_bytes() for name in ("host", "learner", "r1", "r2", "other")}
FP = {name: key_fingerprint(key) for name, key in KEYS.items()}
ID = {"host": "QmHost", "learner": "QmLearner", "r1": "QmR1", "r2": "QmR2", "other": "QmZ9"}  # base58 ids


def beat(
    name: str, role: str, *, version: int = 3, throughput: float = 16.0, seen: float = 1.0, state="running", stats=None
):
    record = PeerRecord(
        peer_id=ID[name],
        role=role,
        adapter_version=version,
        throughput=throughput,
        hardware="x86_64 Linux",
        reachable=True,
        maddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{ID[name]}"],
        started=NOW - 100,
        last_seen=NOW - seen,
        state=state,
        stats=stats or {},
    )
    return KEYS[name], record


BLOBS = {"served_bytes": 1234.0, "fetched_bytes": 5678.0}  # a heartbeat's blob traffic (a peer with a blob service)


def blob_peers() -> list:
    """The swarm of :func:`swarm_status`, its rollout peer reporting blob traffic, the others not."""
    return [
        beat("host", "coordinator", version=0),
        beat("learner", "learner", version=7),
        beat("r1", "rollout", stats=BLOBS),
    ]


def metrics(version: int, **fields) -> MetricsRecord:
    values = dict(
        learner="QmLearner",
        version=version,
        groups_accepted=40,
        groups_dropped_stale=5,
        groups_rejected={"surplus": 2, "reward": 3},
        staleness_mean=1.5,
        staleness_max=3,
        reward_mean=0.5,
        exact_match=None,
        step_seconds=0.3,
        banned=[FP["r2"]],
        per_peer={FP["r1"]: PeerTally(accepted=30, rejected=0), FP["r2"]: PeerTally(accepted=10, rejected=5)},
        reward_history=[0.2, 0.2, 0.4, 0.6],
        created=NOW - 2,
    )
    values.update(fields)
    return MetricsRecord(**values)


def adapter(version: int) -> AdapterRecord:
    return AdapterRecord(
        version=version,
        sha256="b" * 64,
        parent_sha256="c" * 64 if version else "",
        ancestors=["c" * 64] if version else [],
        size=100,
        providers=["QmLearner"],
        created=NOW - 1,
        learner="QmLearner",
    )


def swarm_status(**overrides) -> dict:
    args = dict(
        peers=[beat("host", "coordinator", version=0), beat("learner", "learner", version=7), beat("r1", "rollout")],
        metrics=[(KEYS["learner"], metrics(7))],
        adapters=[(KEYS["learner"], adapter(7))],
        manifests=[(KEYS["host"], status_manifest())],
    )
    args.update(overrides)
    return summarize("run-s", args["peers"], args["metrics"], args["adapters"], args["manifests"], now=NOW)


def test_summary_lists_peers_by_role_with_versions_rates_and_what_the_learners_did_with_their_groups():
    s = swarm_status()
    assert s["run_id"] == "run-s" and s["adapter_version"] == 7 and s["problems"] == []
    assert [(p["role"], p["adapter_version"]) for p in s["peers"]] == [
        ("coordinator", 0),
        ("learner", 7),
        ("rollout", 3),
    ]
    assert s["roles"] == {"coordinator": 1, "learner": 1, "rollout": 1}
    rollout = s["peers"][2]
    assert rollout["groups_per_s"] == 2.0, "a rollout peer's completions/s over the manifest's G = 8"
    assert (rollout["accepted"], rollout["rejected"], rollout["banned"]) == (30, 0, False)
    assert s["peers"][1]["groups_per_s"] == 16.0, "a learner reports groups/s already"
    assert (s["groups_accepted"], s["groups_rejected"], s["groups_dropped_stale"]) == (40, 5, 5)
    assert s["groups_rejected_by_reason"] == {"surplus": 2, "reward": 3} and s["banned"] == [FP["r2"]]
    assert s["manifest"]["coordinator"] == FP["host"] and s["manifest"]["group_size"] == 8
    assert s["reward_history"] == [0.2, 0.2, 0.4, 0.6] and s["reward_trend"] == pytest.approx(0.3)
    json.dumps(s)  # JSON-ready as it is


def test_a_banned_producer_is_marked_and_a_peer_that_missed_two_beats_is_silent_not_live():
    peers = [beat("r1", "rollout", seen=SILENT_AFTER + 1), beat("r2", "rollout"), beat("other", "observer")]
    s = swarm_status(peers=peers)
    by_key = {p["fingerprint"]: p for p in s["peers"]}
    assert by_key[FP["r1"]]["state"] == "silent" and by_key[FP["r2"]]["banned"]
    assert (by_key[FP["r2"]]["accepted"], by_key[FP["r2"]]["rejected"]) == (10, 5)
    assert s["roles"] == {"coordinator": 0, "learner": 0, "rollout": 1}, "a silent peer is listed, not counted"
    assert s["others"] == 1 and all(p["role"] != "observer" for p in s["peers"])
    assert by_key[FP["r1"]]["groups_per_s"] == 2.0


def test_the_newest_version_counts_and_tallies_of_several_learners_add_up():
    second = metrics(9, learner="QmSecond", per_peer={FP["r1"]: PeerTally(accepted=1, rejected=2)}, banned=[])
    s = swarm_status(metrics=[(KEYS["learner"], metrics(7)), (KEYS["other"], second)], adapters=[])
    assert s["adapter_version"] == 9 and [q["version"] for q in s["learners"]] == [9, 7]
    r1 = next(p for p in s["peers"] if p["fingerprint"] == FP["r1"])
    assert (r1["accepted"], r1["rejected"]) == (31, 2)
    assert s["groups_accepted"] == 80 and s["banned"] == [FP["r2"]]


def test_without_any_learner_record_the_version_is_the_announced_one_or_minus_one():
    assert swarm_status(metrics=[], adapters=[(KEYS["host"], adapter(0))])["adapter_version"] == 0
    empty = swarm_status(metrics=[], adapters=[], peers=[], manifests=[])
    assert empty["adapter_version"] == -1 and empty["staleness_mean"] is None and empty["reward_trend"] is None
    assert empty["manifest"] is None and "no manifest" in empty["problems"][0]


def test_the_manifest_is_the_named_coordinators_or_the_heartbeating_coordinators_never_a_guess():
    two = [(KEYS["host"], status_manifest()), (KEYS["other"], status_manifest(group_size=4))]
    assert swarm_status(manifests=two)["manifest"]["coordinator"] == FP["host"], "the one heartbeating as coordinator"
    s = swarm_status(manifests=two, peers=[beat("r1", "rollout")])
    assert s["manifest"] is None and "pass --coordinator" in s["problems"][0]
    assert s["peers"][0]["groups_per_s"] is None, "no G known: no groups/s invented"
    s = summarize("run-s", [], [], [], two, coordinator=FP["other"], now=NOW)
    assert s["manifest"]["group_size"] == 4
    assert swarm_status(manifests=[(KEYS["host"], status_manifest(run_id="elsewhere"))])["manifest"] is None


def test_render_shows_the_run_the_peers_and_the_bans():
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render(swarm_status(peers=[beat("host", "coordinator"), beat("r2", "rollout")])))
    text = console.export_text()
    assert "run run-s" in text and "adapter v7" in text and "addition" in text
    assert "coordinator" in text and "banned" in text and FP["r2"] in text
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"


def test_metrics_record_tallies_and_history_are_bounded_and_fit_the_dht_at_their_largest():
    tallies = {f"{i:016x}": PeerTally(accepted=2**40, rejected=2**40) for i in range(MAX_TALLIED)}
    big = metrics(1, per_peer=tallies, reward_history=[0.5] * MAX_HISTORY, banned=[f"{i:016x}" for i in range(64)])
    from hivemind.utils.serializer import MSGPackSerializer

    assert len(MSGPackSerializer.dumps(to_dht_value(big))) < MAX_DHT_VALUE_BYTES / 2
    with pytest.raises(ValueError):
        metrics(1, per_peer={**tallies, "f" * 16: PeerTally(accepted=0, rejected=0)})
    with pytest.raises(ValueError):
        metrics(1, reward_history=[0.5] * (MAX_HISTORY + 1))
    with pytest.raises(ValueError):
        metrics(1, per_peer={"not-a-fingerprint": PeerTally(accepted=0, rejected=0)})
    with pytest.raises((ValueError, RecordError)):
        metrics(1, per_peer={FP["r1"]: PeerTally(accepted=-1, rejected=0)})


def test_prometheus_text_has_one_typed_sample_per_line_and_escapes_labels():
    s = swarm_status()
    s["peers"][2]["peer_id"] = 'Qm"odd\\'
    text = prometheus(s, exact_match=0.75)
    # one sample per line, labels in name order (so run comes last)
    sample = re.compile(r'hivegrpo_[a-z_]+\{([a-z]+="([^"\\]|\\.)*",)*run="run-s"\} -?[0-9.e+-]+\Z')
    lines = text.strip().splitlines()
    assert all(line.startswith("# ") or sample.match(line) for line in lines), [
        line for line in lines if not line.startswith("# ") and not sample.match(line)
    ]
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    run = ("run", "run-s")
    assert samples[("hivegrpo_adapter_version", (run,))] == 7
    assert samples[("hivegrpo_peers", (("role", "rollout"), run))] == 1
    assert samples[("hivegrpo_groups_rejected_by_reason_total", (("reason", "reward"), run))] == 3
    assert samples[("hivegrpo_exact_match", (run,))] == 0.75
    assert samples[("hivegrpo_peer_adapter_version", (("peer", 'Qm"odd\\'), ("role", "rollout"), run))] == 3
    assert 'peer="Qm\\"odd\\\\"' in text
    assert "hivegrpo_staleness_mean" not in prometheus(swarm_status(metrics=[])), "no learner: no staleness sample"


def test_history_points_and_the_server_routes():
    readings = iter([swarm_status(peers=blob_peers()), swarm_status(metrics=[(KEYS["learner"], metrics(8))])])
    history = StatusHistory(lambda: next(readings), interval=3600)
    server = WebServer(history, port=0).start()
    try:

        def get(path: str):
            with urllib.request.urlopen(server.url + path.lstrip("/"), timeout=10) as r:
                return r.status, r.headers["Content-Type"], r.read()

        with pytest.raises(urllib.error.HTTPError) as e:
            get("/api/status")
        assert e.value.code == 503, "nothing read yet: says so, does not invent a status"
        history.poll()
        first = json.loads(get("/api/status")[2])["peers"]  # what the page draws its peers table from
        assert [(p["role"], p["served_bytes"], p["fetched_bytes"]) for p in first] == [
            ("coordinator", None, None),
            ("learner", None, None),
            ("rollout", 1234, 5678),
        ]
        history.poll()
        code, kind, body = get("/")
        assert code == 200 and kind.startswith("text/html") and b'id="reward-chart"' in body
        assert b">served</th>" in body and b"bytes(p.served_bytes)" in body and b"bytes(p.fetched_bytes)" in body
        status = json.loads(get("/api/status")[2])
        assert status["adapter_version"] == 8 and status["exact_match"] is None
        assert [(p["served_bytes"], p["fetched_bytes"]) for p in status["peers"]] == [(None, None)] * 3
        assert b"hivegrpo_exact_match" not in get("/metrics")[2], "no measurement: no sample"
        history.record_eval(8, 0.625)
        assert json.loads(get("/api/status")[2])["exact_match"]["exact_match"] == 0.625
        assert json.loads(get("/api/history")[2])["evaluations"][0]["adapter_version"] == 8
        assert b'hivegrpo_exact_match{run="run-s"} 0.625' in get("/metrics")[2]
        points = json.loads(get("/api/history")[2])["points"]
        assert [p["adapter_version"] for p in points] == [7, 8]
        assert points[0] == point_of(swarm_status(peers=blob_peers())) and points[0]["rates"] == {"QmR1": 2.0}
        code, kind, body = get("/metrics")
        assert kind.startswith("text/plain") and b'hivegrpo_adapter_version{run="run-s"} 8' in body
        with pytest.raises(urllib.error.HTTPError) as e:
            get("/nothing-here")
        assert e.value.code == 404
    finally:
        server.close()


def test_each_peer_row_has_its_blob_traffic_as_ints_and_none_when_its_heartbeat_does_not_say():
    s = swarm_status(peers=blob_peers())
    by_role = {p["role"]: p for p in s["peers"]}
    rollout = by_role["rollout"]
    assert (rollout["served_bytes"], rollout["fetched_bytes"]) == (1234, 5678)
    assert type(rollout["served_bytes"]) is int and type(rollout["fetched_bytes"]) is int
    for role in ("coordinator", "learner"):
        assert (by_role[role]["served_bytes"], by_role[role]["fetched_bytes"]) == (None, None), "unknown, never 0"
    assert json.loads(json.dumps(s))["peers"][2]["served_bytes"] == 1234


def test_render_shows_blob_traffic_in_human_units_and_a_dash_when_unknown():
    from rich.console import Console

    assert [human_bytes(n) for n in (None, 0, 999, 1234, 99_960, 999_500, 12_300_000, 4_100_000_000)] == [
        "—", "0 B", "999 B", "1.2 kB", "100 kB", "1.0 MB", "12.3 MB", "4.1 GB"
    ]  # fmt: skip
    for width in (100, 120):
        console = Console(width=width, record=True)
        console.print(render(swarm_status(peers=blob_peers())))
        text = console.export_text()
        assert "served" in text and "fetched" in text
        lines = {line.split("│")[2].strip(): line for line in text.splitlines() if line.count("│") > 5}
        assert "1.2 kB" in lines["rollout"] and "5.7 kB" in lines["rollout"], lines
        assert lines["coordinator"].count("—") == 2 and lines["learner"].count("—") == 2
        assert max(map(len, text.splitlines())) <= width


def test_the_hosts_metrics_have_each_reporting_peers_blob_traffic_and_nothing_for_the_others():
    text = prometheus(swarm_status(peers=blob_peers()))
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    r1 = (("peer", "QmR1"), ("role", "rollout"), ("run", "run-s"))
    assert samples[("hivegrpo_peer_blob_served_bytes", r1)] == 1234
    assert samples[("hivegrpo_peer_blob_fetched_bytes", r1)] == 5678
    blob = {k for k in samples if k[0].startswith("hivegrpo_peer_blob_")}
    assert blob == {("hivegrpo_peer_blob_served_bytes", r1), ("hivegrpo_peer_blob_fetched_bytes", r1)}, blob
    assert "hivegrpo_peer_blob_" not in prometheus(swarm_status()), "no peer reports it: no sample, not a 0"


def _rollout_peer(heartbeat_stats):
    """The little of a rollout peer :class:`~peer.metrics.RolloutCollector` reads, its heartbeat's stats given."""
    from types import SimpleNamespace

    fields = {"throughput": 16.0} if heartbeat_stats is None else {"throughput": 16.0, "stats": heartbeat_stats}
    session = SimpleNamespace(
        heartbeat=SimpleNamespace(fields=lambda: dict(fields)),
        swarm=SimpleNamespace(peer_id="QmR1", public_key=KEYS["r1"]),
    )
    counts = dict(groups=2, completions=16, tokens=64, batches=1, swaps=1, waited_s=0.0, sample_s=1.0)
    return SimpleNamespace(
        stats=counts, session=session, publisher=None, follower=None, spec=None, version=3, batch_size=4,
        config=SimpleNamespace(run_id="run-s"),
    )  # fmt: skip


def test_a_peers_own_metrics_count_its_blob_traffic_from_its_heartbeat_when_it_has_it():
    from prometheus_client import CollectorRegistry, generate_latest

    from peer.metrics import RolloutCollector

    def scrape(stats) -> dict:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RolloutCollector(_rollout_peer(stats)))
        text = generate_latest(registry).decode()
        return {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples if not x.labels}

    got = scrape(BLOBS)
    assert got["hivegrpo_blob_served_bytes_total"] == 1234 and got["hivegrpo_blob_fetched_bytes_total"] == 5678
    assert got["hivegrpo_rollout_groups_sampled_total"] == 2
    for stats in (None, {"busy": 0.5}):  # no stats in the heartbeat yet; a heartbeat without blob counts
        assert not {name for name in scrape(stats) if "blob" in name}, "unknown: left out, not 0"


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_the_page_writes_blob_traffic_as_the_terminal_does():
    from coordinator.web import page

    script = re.search(r"function bytes\(n\) \{.*?\n\}\n", page().decode(), re.S).group(0)
    values = [None, 0, 999, 1234, 5678, 99_960, 999_500, 12_300_000, 4_100_000_000]
    run = script + f"console.log(JSON.stringify({json.dumps(values)}.map(bytes)));"
    done = subprocess.run(["node", "-e", '"use strict";' + run], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [human_bytes(n) for n in values]
    assert json.loads(done.stdout)[:4] == ["—", "0 B", "999 B", "1.2 kB"]


def test_a_negative_blob_count_in_a_heartbeat_shows_as_unknown():
    lying = [beat("host", "coordinator", version=0), beat("r1", "rollout", stats={"served_bytes": -5.0})]
    (host, rollout) = sorted(swarm_status(peers=lying)["peers"], key=lambda p: p["role"])
    assert rollout["role"] == "rollout" and rollout["served_bytes"] is None and rollout["fetched_bytes"] is None
