"""The coordinator in real processes: `hivegrpo host` (with its web page) + `join` + `learn`, `hivegrpo status`,
the host killed with SIGKILL mid-run (the swarm keeps going) and restarted with the same identity (it rejoins).

The same run checks the contributors' credit (peer.run.credit): the rollout peer's --name and its groups used
in status, the page and the join's progress line; a stranger's forged credit record ignored; credit that survives
the host's restart (its state file) and the learner's SIGKILL (its journal), no count ever going down."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from tests.helpers.swarm import LOOPBACK, fingerprint, join_args, learn_args, start_host, status
from tests.helpers.waiting import wait_until

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
    assert '<tr class="contributor"><td>alice-laptop</td>' in dom, "the contributors table names the rollout peer"

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


def api_status(web: str) -> dict | None:
    """The host's ``/api/status``, or None while it has no reading yet (503)."""
    try:
        return json.loads(get(web + "api/status"))
    except urllib.error.HTTPError as e:
        if e.code == 503:
            return None
        raise


def credit_of(s: dict | None, fp: str) -> dict | None:
    """The contributor ``fp``'s row of a status' contributors table."""
    return next((c for c in (s or {}).get("contributors", []) if c["fingerprint"] == fp), None)


@pytest.mark.timeout(480)
def test_status_web_page_and_a_swarm_that_outlives_its_coordinator(tmp_path, procs, reader):
    identity = tmp_path / "host.id"
    args = ("--identity", str(identity), "--web-port", "0", "--groups-per-version", "4", "--eval-every", "4")
    args += ("--eval-n", "40")
    host, info = start_host(procs, tmp_path, "coord1", *args, new_session=True)
    host_id = info["initial_peers"][0].rsplit("/p2p/", 1)[1]
    named = ("--name", "alice-laptop", "--identity", str(tmp_path / "r.id"))
    rollout = procs.start(
        "rollout", "join", *join_args(info), "--cache-dir", str(tmp_path / "r"), "--batch-size", "4", *named
    )
    alice = fingerprint(tmp_path / "r.id")
    learn = ["--cache-dir", str(tmp_path / "l"), "--identity", str(tmp_path / "l.id"), "--json"]
    learn += ["--checkpoint-dir", str(tmp_path / "l.ckpt"), "--checkpoint-every", "1000"]  # all in the journal
    learner = procs.start("learner", "learn", *learn_args(info), *learn, new_session=True)
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
        lambda: (
            (s := status("coord1", info["initial_peers"]))["adapter_version"] > first["adapter_version"]
            and all(p["state"] == "running" for p in s["peers"])  # a state change shows at the peer's next beat
            and s
        ),
        "a higher adapter version, every peer running",
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
    assert roles["rollout"][0]["name"] == "alice-laptop", "the --name in the heartbeat"
    assert [p["state"] for p in second["peers"]] == ["running"] * 3, "a learner making versions is running too"

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
    credited = wait_until(
        lambda: (c := credit_of(api_status(web), alice)) and c["used"] > 0 and c,
        "the page's contributors",
        60,
        running,
    )
    assert credited["name"] == "alice-laptop" and credited["share"] == 1.0 and credited["since"] <= time.time()
    metrics = get(web + "metrics").decode()
    assert 'hivegrpo_peers{role="rollout",run="coord1"} 1.0' in metrics and "hivegrpo_adapter_version" in metrics
    render_page(web, tmp_path)

    # SIGKILL of the coordinator with its DHT process and libp2p daemon: rollout peer and learner keep going
    others = [m for p in second["peers"] if p["role"] != "coordinator" for m in p["maddrs"]]
    seen_by_host = credit_of(api_status(web), alice)  # the host's last reading (saved before it was shown)
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
    # its first reading shows the contributors it kept (identity.run.credit.json), counts no lower than before
    at_once = wait_until(lambda: api_status(info2["web"]), "the restarted host's first reading", 30, [host2])
    assert credit_of(at_once, alice)["used"] >= seen_by_host["used"], at_once["contributors"]
    assert "showing the credit of 1 contributor(s) kept in" in procs.log(host2)

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

    # the learner killed with SIGKILL between checkpoints and restarted from its journal (while it starts: a
    # stranger's credit record, and `status --contributors`): no contributor's count goes down, and they grow again
    from peer.protocol import Credit, CreditRecord, credit_key, key_fingerprint, owner_subkey, to_dht_value
    from peer.run.credit import read_credits
    from peer.status import read_status

    swarm, _ = reader("coord1", [*info2["initial_peers"], *others])
    learner_key = fingerprint(tmp_path / "l.id")

    def learners_own():
        records = [r for signer, r in read_credits(swarm) if key_fingerprint(signer) == learner_key]
        return records[0] if records else None

    before = wait_until(learners_own, "the learner's credit record", 30)
    procs.kill_group(learner)
    learner2 = procs.start("learner2", "learn", *learn_args(info2), *learn, new_session=True)  # through host2

    # a stranger publishes a credit record giving itself and the rollout peer a billion groups: ignored
    billion = Credit(name="mallory", used=10**9, refused=0, reasons={}, stale=0, no_signal=0, since=1.0)
    forged = CreditRecord(
        learner=str(swarm.peer_id),
        version=0,
        groups_used=2 * 10**9,
        contributors_known=2,
        contributors={alice: billion, "00000000deadbeef": billion},
        created=time.time(),
    )
    key, me = credit_key("coord1"), owner_subkey(swarm.public_key)
    assert swarm.store(key, me, to_dht_value(forged), time.time() + 300, "forged credit")
    stranger = key_fingerprint(swarm.public_key)
    seen = wait_until(
        lambda: (
            (s := read_status(swarm, info["coordinator"]))
            and any(r["fingerprint"] == stranger for r in s["refused"])
            and s
        ),
        "status naming the stranger's credit record",
        60,
    )
    assert [c["fingerprint"] for c in seen["contributors"]] == [alice], seen["contributors"]
    assert before.contributors[alice].used <= credit_of(seen, alice)["used"] < 10**9
    assert len(read_credits(swarm)) >= 2, "the forged record is in the DHT (it is well-formed): readers ignore it"

    # `status --contributors` names the rollout peer by its --name
    peers = [a for m in info2["initial_peers"] for a in ("--initial-peers", m)]
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "status", "--run-id", "coord1", *peers, *LOOPBACK, "--contributors"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if "alice-laptop" in line and alice[:8] in line]
    assert len(rows) == 1 and "100.0%" in rows[0], out.stdout  # its row of the contributors table

    grown = wait_until(
        lambda: (
            (r := learners_own())
            and r.created > before.created
            and r.contributors[alice].used > before.contributors[alice].used
            and r
        ),
        "the restarted learner's credit growing again",
        150,
        [learner2, rollout],
    )
    for fp, credit in before.contributors.items():
        after = grown.contributors[fp]
        assert after.used >= credit.used and after.refused >= credit.refused and after.since <= credit.since, fp
    assert "00000000deadbeef" not in grown.contributors and grown.contributors[alice].used < 10**9
    host_view = wait_until(
        lambda: (
            (c := credit_of(api_status(info2["web"]), alice)) and c["used"] >= grown.contributors[alice].used and c
        ),
        "the host's page with the restarted learner's credit",
        60,
    )
    assert host_view["name"] == "alice-laptop"

    for p in (rollout, learner2, host2):
        p.send_signal(signal.SIGTERM)
    deadline = time.time() + 90
    outputs = {}
    for p in (rollout, learner2, host2):
        outputs[p.pid] = p.communicate(timeout=max(1, deadline - time.time()))[0]
        assert p.returncode == 0, procs.log(p)[-3000:]
    resumed = json.loads(outputs[learner2.pid].strip().splitlines()[-1])
    assert resumed["resumed_from"].startswith("journal") and resumed["credit"]["published"] >= 1, resumed

    # the volunteer's progress line (plain: its stderr is a file), every ~10 s; adapter swaps only at DEBUG
    log = procs.log(rollout)
    lines = re.findall(
        r"progress: v(\d+) · ([\d.]+) groups/s · made (\d+) · used (\d+) \(\d+%\) · refused (\d+).* · lag ([\d.]+)",
        log,
    )
    assert len(lines) >= 3 and any(int(used) > 0 for _, _, _, used, _, _ in lines), log[-3000:]
    assert "now sampling with adapter" not in log
