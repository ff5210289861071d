"""The host's web server against what a stranger's client or page can do: a silent client, too many clients, a
page elsewhere rebinding its name to 127.0.0.1, names with markup; and the loopback defaults that keep the page
and the metrics off the network unless asked."""

import http.client
import re
import shutil
import socket
import subprocess
import time

import pytest

from coordinator.web import StatusHistory, WebServer, host_name, is_loopback, page


@pytest.fixture
def server():
    made = []

    def start(**options) -> WebServer:
        history = StatusHistory(lambda: {"peers": []}, interval=3600)
        history.latest = {"peers": []}
        web = WebServer(history, "127.0.0.1", 0, **options).start()
        made.append(web)
        return web

    yield start
    for web in made:
        web.close()


def get(web: WebServer, path: str, host: str) -> int:
    port = web.httpd.server_address[1]
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.putrequest("GET", path, skip_host=True)
    connection.putheader("Host", host)
    connection.endheaders()
    try:
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_loopback_server_answers_only_requests_naming_a_loopback_host(server):
    web = server()
    port = web.httpd.server_address[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]:8080", "localhost"):
        assert get(web, "/api/status", host) == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", ""):
        assert get(web, "/api/status", host) == 421, host


def test_a_silent_client_is_closed_and_clients_past_the_bound_are_refused(server):
    web = server(timeout=0.5, max_clients=2)
    address = web.httpd.server_address
    silent = [socket.create_connection(address, timeout=5) for _ in range(2)]
    time.sleep(0.2)
    extra = socket.create_connection(address, timeout=5)
    assert extra.recv(1) == b"", "a third client while two are served: closed unanswered"
    extra.close()
    started = time.monotonic()
    assert all(s.recv(1) == b"" for s in silent), "silent clients are closed"
    assert time.monotonic() - started < 4, "within the timeout, not never"
    for s in silent:
        s.close()
    assert get(web, "/api/status", "localhost") == 200, "their slots are free again"


def test_host_names_and_loopback():
    assert host_name("localhost:8080") == "localhost" and host_name("[::1]:1") == "[::1]"
    assert host_name("evil.example") == "evil.example"
    assert is_loopback("127.3.4.5") and is_loopback("[::1]") and not is_loopback("0.0.0.0")
    assert not is_loopback("localhost.evil.example")


def test_the_page_and_the_metrics_listen_on_loopback_unless_asked():
    from coordinator.cli import host_cmd
    from peer.cli import join_cmd, learn_cmd
    from peer.roles.learner.peer import LearnerConfig
    from peer.roles.rollout.peer import RolloutConfig

    defaults = {p.name: p.default for p in host_cmd.params}
    assert defaults["web_host"] == "127.0.0.1" and defaults["web_port"] is None
    for command in (join_cmd, learn_cmd):
        assert {p.name: p.default for p in command.params}["metrics_host"] == "127.0.0.1"
    assert LearnerConfig(run_id="r").metrics_host == "127.0.0.1" == RolloutConfig(run_id="r").metrics_host


def test_every_name_the_page_shows_goes_through_its_escaping():
    html = page().decode()
    shown = re.findall(r"\$\{([^}]*\b(?:name|hardware|peer_id|fingerprint|why)\b[^}]*)\}", html)
    assert shown, "the page shows names"
    assert all(expr.lstrip().startswith(("esc(", "c.name ? esc(", "p.name ? esc(")) for expr in shown), shown


@pytest.mark.skipif(shutil.which("node") is None, reason="the page's escaping is run in Node.js, not installed here")
def test_the_pages_escaping_turns_markup_into_text():
    html = page().decode()
    esc = re.search(r"function esc\(v\) \{.*?\}\n", html, re.S).group(0)
    markup = '<img src=x onerror="alert(1)">&'
    out = subprocess.run(
        ["node", "-e", esc + f"process.stdout.write(esc({markup!r}))"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;"


def test_thousands_of_fake_heartbeats_make_a_bounded_status_point_and_scrape():
    """The review's M2: every rollout heartbeat got a rate in every status point (4,320 kept) and a series in every
    scrape: 3,500 fake ones made 0.5 MiB a point and ~14,000 series."""
    from coordinator.metrics import MAX_PEER_SERIES, prometheus
    from coordinator.web import point_of

    def peer(i: int, role: str = "rollout", rate: float = 1.0) -> dict:
        return {"peer_id": f"12D3KooFake{i}", "role": role, "state": "running", "groups_per_s": rate,
                "adapter_version": 3, "served_bytes": 0, "fetched_bytes": 0}  # fmt: skip

    honest = [peer(-1, rate=50.0), peer(-2, "learner", 0.0), peer(-3, "coordinator", 0.0)]
    fakes = [peer(i, rate=i / 1000) for i in range(3500)]
    status = {"time": 1.0, "adapter_version": 3, "reward_mean": 0.5, "staleness_mean": 1.0, "groups_accepted": 10,
              "groups_rejected": 0, "roles": {"rollout": 3501}, "peers": fakes + honest, "run_id": "r",
              "groups_rejected_by_reason": {}, "groups_dropped_stale": 0, "banned": []}  # fmt: skip
    rates = point_of(status)["rates"]
    assert len(rates) == MAX_PEER_SERIES and "12D3KooFake-1" in rates, "the busiest, the honest one among them"
    text = prometheus(status)
    series = [line for line in text.splitlines() if line.startswith("hivegrpo_peer_groups_per_second{")]
    assert len(series) == MAX_PEER_SERIES + 2, len(series)
    assert any('peer="12D3KooFake-2"' in line for line in series), "learners are always labelled"
