"""A demo child started beside its host (peer.demo.prestart): what it puts in place of the host's placeholders,
and how it waits for the host's info file."""

import json
import os
import threading
import time

from peer.demo.prestart import CREDENTIAL, JOIN, expand, wait_for

INFO = {
    "coordinator": "0123456789abcdef",
    "initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/A", "/ip4/127.0.0.1/tcp/2/p2p/B"],
    "learner_credential": "cred",
}


def test_the_placeholders_become_the_hosts_address_and_credential_and_nothing_else_changes():
    argv = ["learn", "--run-id", "demo", JOIN, "--learner-credential", CREDENTIAL, "--json"]
    assert expand(argv, INFO) == [
        "learn", "--run-id", "demo",
        "--coordinator", "0123456789abcdef",
        "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/A", "--initial-peers", "/ip4/127.0.0.1/tcp/2/p2p/B",
        "--learner-credential", "cred", "--json",
    ]  # fmt: skip
    assert expand(["join", "--name", "x"], INFO) == ["join", "--name", "x"]


def test_it_waits_for_the_info_file_and_gives_up_after_the_timeout(tmp_path):
    path = tmp_path / "info.json"
    started = time.monotonic()
    assert wait_for(path, 0.3, os.getppid()) is None
    assert 0.3 <= time.monotonic() - started < 5
    threading.Timer(0.3, lambda: path.write_text(json.dumps(INFO))).start()
    assert wait_for(path, 30, os.getppid()) == INFO


def test_it_gives_up_when_the_process_that_started_it_is_gone(tmp_path):
    started = time.monotonic()
    assert wait_for(tmp_path / "never.json", 30, os.getppid() + 1) is None, "another parent: the demo left"
    assert time.monotonic() - started < 5
