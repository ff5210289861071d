"""The coordinator in real processes: `hivegrpo host` (with its web page) + `join` + `learn`, `hivegrpo status`,
the host killed with SIGKILL mid-run (the swarm keeps going) and restarted with the same identity (it rejoins)."""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from tests.swarm_helpers import join_args, learn_args, start_host, status, wait_until

pytestmark = pytest.mark.integration

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REWARD_BLUE = (0x2B, 0x6C, 0xB0)  # the reward series' colour on the page


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def by_role(s: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in s["peers"]:
        out.setdefault(p["role"], []).append(p)
    return out


def render_page(url: str, tmp_path: Path) -> None:
    """The page in headless Chromium: the reward chart has a line of several points, and the screenshot shows it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("HIVEGRPO_REQUIRE_BROWSER"):
            pytest.fail("chromium is not installed (apt-get install chromium), and this run requires the browser")
        warnings.warn("chromium is not installed: the status page was not rendered", stacklevel=1)
        return
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=10000"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    from html.parser import HTMLParser

    lines: dict[str, int] = {}

    class Lines(HTMLParser):
        chart = None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "svg":
                self.chart = a.get("id")
            if tag == "polyline" and self.chart:
                lines[f"{self.chart}/{a.get('data-name')}"] = int(a.get("data-points", 0))

    Lines().feed(dom)
    assert lines.get("reward-chart/reward mean", 0) >= 2, f"the reward chart has no line: {lines}"
    assert lines.get("version-chart/adapter version", 0) >= 2, lines
    assert lines.get("reward-chart/exact match (host's evaluation)", 0) >= 2, lines
    assert "rollout" in dom and "learner" in dom, "the peers table lists the swarm"

    artifacts = Path(os.environ.get("HIVEGRPO_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "status-page.png"
    subprocess.run(
        [chromium, *flags, "--window-size=1300,1000", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    width, height = image.size
    chart = image.crop((0, 0, width // 2, height // 2))  # the reward chart is the first card, top left
    blue = sum(1 for p in chart.getdata() if all(abs(c - b) <= 24 for c, b in zip(p, REWARD_BLUE, strict=True)))
    assert blue >= 80, f"the screenshot's reward chart shows {blue} pixels of the reward line"


@pytest.mark.timeout(420)
def test_status_web_page_and_a_swarm_that_outlives_its_coordinator(tmp_path, procs):
    identity = tmp_path / "host.id"
    args = ("--identity", str(identity), "--web-port", "0", "--groups-per-version", "4", "--eval-every", "4")
    args += ("--eval-n", "40")
    host, info = start_host(procs, tmp_path, "coord1", *args, new_session=True)
    host_id = info["initial_peers"][0].rsplit("/p2p/", 1)[1]
    rollout = procs.start("rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4")
    learner = procs.start("learner", "learn", *learn_args(info), "--cache-dir", str(tmp_path / "l"))
    running = [host, rollout, learner]

    # status lists all three with their roles, and the adapter version rises between two readings
    def everyone(maddrs, at_least):
        s = status("coord1", maddrs)
        roles = by_role(s)
        ok = all(len(roles.get(r, [])) == 1 for r in ("coordinator", "rollout", "learner"))
        return s if ok and s["adapter_version"] >= at_least else None

    first = wait_until(lambda: everyone(info["initial_peers"], 2), "status listing the three peers", 180, running)
    assert first["manifest"]["coordinator"] == info["coordinator"] and first["problems"] == []
    assert by_role(first)["coordinator"][0]["peer_id"] == host_id
    second = wait_until(
        lambda: (s := status("coord1", info["initial_peers"]))["adapter_version"] > first["adapter_version"] and s,
        "a higher adapter version",
        90,
        running,
    )
    roles = by_role(second)
    assert {p["role"] for p in second["peers"]} == {"coordinator", "rollout", "learner"}
    assert all(isinstance(p["adapter_version"], int) for p in second["peers"])
    assert second["groups_accepted"] > 0 and second["groups_rejected"] == second["groups_rejected_by_reason"].get(
        "surplus", 0
    ), second["groups_rejected_by_reason"]
    assert roles["rollout"][0]["accepted"] > 0 and second["banned"] == []

    # the web page: JSON API, Prometheus, and the page itself rendered in a browser
    web = info["web"]

    def plotted():
        h = json.loads(get(web + "api/history"))
        rewarded = [p for p in h["points"] if p["reward_mean"] is not None]  # polled after the learner's metrics
        measured = {e["adapter_version"] for e in h["evaluations"]}
        return h if len(h["points"]) >= 3 and len(rewarded) >= 2 and len(measured) >= 2 else None

    history = wait_until(plotted, "three status points, two with a reward, and two versions measured", 120, running)
    measured = [e["adapter_version"] for e in history["evaluations"]]
    assert measured[0] == 0 and measured == sorted(measured), "v0 first, then ever newer versions"
    assert all(0 <= e["exact_match"] <= 1 for e in history["evaluations"])
    api = json.loads(get(web + "api/status"))
    assert api["run_id"] == "coord1" and api["adapter_version"] >= first["adapter_version"]
    metrics = get(web + "metrics").decode()
    assert 'hivegrpo_peers{run="coord1",role="rollout"} 1' in metrics and "hivegrpo_adapter_version" in metrics
    render_page(web, tmp_path)

    # SIGKILL of the coordinator with its DHT process and libp2p daemon: rollout peer and learner keep going
    others = [m for p in second["peers"] if p["role"] != "coordinator" for m in p["maddrs"]]
    procs.kill_group(host)
    killed_at = status("coord1", others)
    v_killed, used_killed = killed_at["adapter_version"], by_role(killed_at)["rollout"][0]["accepted"]
    later = wait_until(
        lambda: (s := status("coord1", others))["adapter_version"] >= v_killed + 5 and s,
        "versions made without the coordinator",
        120,
        [rollout, learner],
    )
    assert by_role(later)["rollout"][0]["accepted"] > used_killed, "the rollout peer's groups are still used"
    assert later["manifest"] is not None, "the manifest outlives its writer (other peers hold it)"

    # restarted with the same identity and no --initial-peers: it rejoins through the peers it saw
    host2, info2 = start_host(procs, tmp_path, "coord1", *args, name="host2")
    assert info2["coordinator"] == info["coordinator"] and info2["initial_peers"][0].endswith(host_id)
    assert "rejoined the swarm through" in procs.log(host2)

    def rejoined():
        s = status("coord1", others)
        hosts = [p for p in by_role(s).get("coordinator", []) if p["state"] == "running" and p["uptime_s"] < 60]
        return s if hosts and hosts[0]["peer_id"] == host_id else None

    wait_until(rejoined, "the restarted coordinator in the swarm's status", 90, [host2, rollout, learner])
    mine = wait_until(
        lambda: (s := json.loads(get(info2["web"] + "api/status")))["roles"]["learner"] == 1 and s,
        "the restarted host seeing the learner",
        60,
        [host2],
    )
    assert mine["roles"]["rollout"] == 1 and mine["adapter_version"] > v_killed

    for p in (rollout, learner, host2):
        p.send_signal(signal.SIGTERM)
    deadline = time.time() + 90
    for p in (rollout, learner, host2):
        p.communicate(timeout=max(1, deadline - time.time()))
        assert p.returncode == 0, procs.log(p)[-3000:]
