"""Status: a learner's busy fraction and share of groups without signal, per peer and for the learner that leads.

Records are built here as in tests/unit/test_status_units.py; the learner's heartbeat ``stats`` carry what it measures.
"""

import json

from rich.console import Console

from peer.protocol import PeerRecord, key_fingerprint
from peer.status import SILENT_AFTER, render, summarize
from tests.helpers.status import NOW, status_manifest

NAMES = ("host", "lead", "helper", "solo", "r1")
KEYS = {name: f"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/status-{name}==".encode() for name in NAMES}
FP = {name: key_fingerprint(key) for name, key in KEYS.items()}
ID = {"host": "QmHost", "lead": "QmLead", "helper": "QmAide", "solo": "QmMono", "r1": "QmR1"}


def beat(name: str, role: str, *, stats=None, seen: float = 1.0, state: str = "running"):
    record = PeerRecord(
        peer_id=ID[name],
        role=role,
        adapter_version=3,
        throughput=16.0,
        hardware="x86_64 Linux",
        reachable=True,
        maddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{ID[name]}"],
        started=NOW - 100,
        last_seen=NOW - seen,
        state=state,
        stats=stats or {},
    )
    return KEYS[name], record


def status(*peers) -> dict:
    return summarize(
        "run-s", [beat("host", "coordinator"), *peers], [], [], [(KEYS["host"], status_manifest())], now=NOW
    )


def row(s: dict, name: str) -> dict:
    return next(p for p in s["peers"] if p["fingerprint"] == FP[name])


LEADS = {"leading": 1.0, "busy": 0.42, "no_signal_share": 0.375}
HELPS = {"leading": 0.0, "busy": 0.9, "no_signal_share": 0.1}


def test_each_learner_row_shows_its_busy_fraction_and_no_signal_share():
    s = status(beat("lead", "learner", stats=LEADS), beat("helper", "learner", stats=HELPS), beat("r1", "rollout"))
    assert (row(s, "lead")["busy"], row(s, "lead")["no_signal_share"]) == (0.42, 0.375)
    assert (row(s, "helper")["busy"], row(s, "helper")["no_signal_share"]) == (0.9, 0.1)
    assert (row(s, "lead")["team"], row(s, "helper")["team"]) == ("leads", "helps")
    json.dumps(s)


def test_only_learners_report_busy():
    s = status(beat("r1", "rollout", stats={"busy": 0.5, "no_signal_share": 0.5}), beat("lead", "learner"))
    assert (row(s, "r1")["busy"], row(s, "r1")["no_signal_share"]) == (None, None), "a rollout peer's word is no"
    assert row(s, "host")["busy"] is None
    assert (row(s, "lead")["busy"], row(s, "lead")["no_signal_share"]) == (None, None), "not measured: none"


def test_the_top_level_figures_are_the_leaders_not_a_helpers():
    for order in ((LEADS, HELPS), (HELPS, LEADS)):  # whatever order the heartbeats come in
        peers = [beat("lead", "learner", stats=order[0]), beat("helper", "learner", stats=order[1])]
        s = status(*peers)
        leading = order[0] if order[0]["leading"] else order[1]
        expected = leading["busy"], leading["no_signal_share"]
        assert (s["learner_busy"], s["no_signal_share"]) == expected


def test_a_learner_without_a_team_is_the_one_that_leads():
    s = status(beat("solo", "learner", stats={"busy": 0.25, "no_signal_share": 0.0}))
    assert row(s, "solo")["team"] is None
    assert (s["learner_busy"], s["no_signal_share"]) == (0.25, 0.0)


def test_no_live_leader_with_figures_means_none():
    assert (status()["learner_busy"], status()["no_signal_share"]) == (None, None), "no learner"
    only_helper = status(beat("helper", "learner", stats=HELPS))
    assert (only_helper["learner_busy"], only_helper["no_signal_share"]) == (None, None), "a helper does not lead"
    silent = status(beat("lead", "learner", stats=LEADS, seen=SILENT_AFTER + 1))
    assert row(silent, "lead")["state"] == "silent" and silent["learner_busy"] is None, "a silent leader is not live"
    leaving = status(beat("lead", "learner", stats=LEADS, state="leaving"))
    assert leaving["learner_busy"] is None
    unmeasured = status(beat("lead", "learner", stats={"leading": 1.0}), beat("helper", "learner", stats=HELPS))
    assert unmeasured["learner_busy"] is None, "the leader has not measured yet: a helper's figure is not shown"


def test_a_dead_leader_does_not_hide_the_live_one():
    s = status(
        beat("lead", "learner", stats={**LEADS, "busy": 0.99}, seen=SILENT_AFTER + 5),
        beat("solo", "learner", stats={"leading": 1.0, "busy": 0.3, "no_signal_share": 0.5}),
    )
    assert (s["learner_busy"], s["no_signal_share"]) == (0.3, 0.5)


def rendered(s: dict) -> str:
    console = Console(width=200, record=True)
    console.print(render(s))
    return console.export_text()


def test_render_shows_the_learners_busy_fraction_and_groups_without_signal():
    text = rendered(status(beat("lead", "learner", stats=LEADS), beat("helper", "learner", stats=HELPS)))
    assert "learner busy 42%" in text
    assert "groups without signal 38%" in text  # 0.375 rounds half to even: 38 %
    assert "learner busy 90%" not in text


def test_render_leaves_out_what_is_not_measured():
    text = rendered(status(beat("lead", "learner", stats={"leading": 1.0})))
    assert "learner busy" not in text and "without signal" not in text
    text = rendered(status(beat("lead", "learner", stats={"leading": 1.0, "busy": 0.05})))
    assert "learner busy 5%" in text and "without signal" not in text
