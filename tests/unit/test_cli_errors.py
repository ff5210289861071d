"""Bad input on the command line: one line naming the option and the fix, before any model loads.

Each case runs the real command, ``python -X importtime -m peer.cli ...``, in a subprocess. A bad option value
must exit 2 with click's one ``Error:`` line, and the import log must show that transformers was never imported
(nothing can load a model without it) and the output that no swarm was joined. An error only found while running
(a swarm that does not answer, an invite id the book does not hold) exits 1, also with one line. No case may print
a traceback. The cases run two at a time (the test machines have two cores).
"""

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

# a well-formed multiaddr of a peer nobody runs (port 9, discard)
PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGzHoVsiyoaq4Mr4o9mvxwsRY4nA6nTfxvmKmVKbpKvTM"
TRANSFORMERS = re.compile(r"^import time:.*\|\s+transformers\s*$", re.M)
OUR_VARIABLES = ("HIVEGRPO_INVITE", "HIVEGRPO_LEARNER_CREDENTIAL", "HIVEGRPO_LOG_LEVEL")


@dataclass
class Case:
    argv: list[str]
    code: int
    says: tuple[str, ...]  # each must be in the one Error line
    env: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Junk identity files, a file where a folder is needed, a host identity and tokens issued with it."""
    from coordinator.invites import InviteBook
    from peer.network.access import issue_invite
    from peer.network.admission import issue_credential
    from peer.network.swarm import load_signing_key

    d = tmp_path_factory.mktemp("cli-errors")
    (d / "junk.id").write_bytes(b"junk")
    (d / "junkkey.id.rsa").write_bytes(b"junk")
    (d / "afile").write_text("x")
    (d / "empty").mkdir()
    host = d / "host.id"
    load_signing_key(str(host))
    other = InviteBook(host, "other-run")
    book = InviteBook(host, "r")
    return {
        "dir": d,
        "host": str(host),
        "other_invite": other.issue("x").token,
        "other_credential": other.issue_learner("x").token,
        "expired_invite": issue_invite(book.issuer, "r", "x", 1.0).token,  # expired in 1970
        "expired_credential": issue_credential(book.signing_key, "r", "x", 1.0).token,
    }


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def cases(f: dict, busy_port: int) -> list[Case]:
    d, host = f["dir"], f["host"]
    afile, junk, junk_key = f"{d}/afile", f"{d}/junk.id", f"{d}/junkkey.id"
    join, learn = ["join", "--run-id", "r"], ["learn", "--run-id", "r"]
    credential = ["--learner-credential", f["other_credential"]]
    invite = ["invite", "--identity", host, "--run-id", "r"]
    return [
        # the command itself
        Case(["--log-level", "verbose", "eval", "--n", "5"], 2, ("'--log-level'", "'verbose'", "'debug'")),
        Case(["eval", "--n", "5"], 2, ("HIVEGRPO_LOG_LEVEL", "'verbose'"), env={"HIVEGRPO_LOG_LEVEL": "verbose"}),
        Case(["--log-level", "debug", "eval", "--help"], 0, ()),  # any case is fine
        Case(["no-such-command"], 2, ("No such command",)),
        # demo
        Case(["demo", "--duration", "0"], 2, ("'--duration'",)),
        Case(["demo", "--report-dir", f"{afile}/report"], 2, ("'--report-dir'", "is a file")),
        # join: the network options, shared by learn, status and host
        Case([*join, "--initial-peers", "ip4/1.2.3.4"], 2, ("'--initial-peers'", "begin with /", "/p2p/12D3KooW")),
        Case([*join, "--initial-peers", "/ip4/1.2.3.4/tcp/5"], 2, ("'--initial-peers'", "no /p2p/PEER_ID")),
        Case([*join, "--host-maddrs", "/ip4/x/tcp/0"], 2, ("'--host-maddrs'", "/ip4/0.0.0.0/tcp/31337")),
        Case([*join, "--announce-maddrs", "/ip4/1.2.3.4/tcp/0"], 2, ("'--announce-maddrs'", "port 0")),
        Case([*join, "--identity", junk], 2, ("'--identity'", "corrupt identity file", "move it away")),
        Case([*join, "--identity", junk_key], 2, ("'--identity'", "corrupt signing key", "move it away")),
        Case([*join, "--identity", f"{afile}/id"], 2, ("'--identity'", "is a file")),
        Case([*join, "--invite", "junk"], 2, ("'--invite'", "not a hivegrpo invite")),
        Case(join, 2, ("HIVEGRPO_INVITE", "damaged"), env={"HIVEGRPO_INVITE": "hgi1.junk"}),
        Case([*join, "--initial-peers", PEER, "--invite", f["other_invite"]], 2, ("'--invite'", "'other-run'")),
        Case(["join", "--run-id", "bad id"], 2, ("'--run-id'", "letters, digits")),
        Case([*join, "--coordinator", "zz"], 2, ("'--coordinator'", "16 hex digits")),
        Case([*join, "--batch-size", "0"], 2, ("'--batch-size'", "'auto'")),
        Case([*join, "--max-memory", "lots"], 2, ("'--max-memory'", "6GiB")),
        Case([*join, "--device", "gpu"], 2, ("'--device'", "cuda:N")),
        Case([*join, "--ledger", f"{afile}/ledger.jsonl"], 2, ("'--ledger'", "is a file")),
        Case([*join, "--cache-dir", f"{afile}/cache"], 2, ("'--cache-dir'", "is a file")),
        Case([*join, "--allow-task", "mod:Task"], 2, ("'--allow-task'", "module only")),
        # learn
        Case(learn, 2, ("'--learner-credential'", "learn line")),
        Case([*learn, "--learner-credential", "junk"], 2, ("'--learner-credential'", "not a hivegrpo learner")),
        Case([*learn, *credential], 2, ("'--learner-credential'", "'other-run'", "--run-id")),
        Case([*learn, "--learner-credential", f["expired_credential"]], 2, ("'--learner-credential'", "expired")),
        Case([*learn, *credential, "--lr", "0"], 2, ("'--lr'",)),
        Case([*learn, *credential, "--checkpoint-dir", afile], 2, ("'--checkpoint-dir'", "is a file")),
        # status
        Case(["status", "--run-id", "r"], 2, ("--initial-peers",)),
        Case(["status", "--run-id", "bad.id"], 2, ("'--run-id'", "'bad.id'")),
        Case(["status", "--run-id", "r", "--watch", "0"], 2, ("'--watch'",)),
        Case(["status", "--run-id", "r", "--invite", f["expired_invite"]], 2, ("'--invite'", "expired")),
        Case(["status", "--run-id", "r", "--initial-peers", PEER], 1, ("could not join the swarm", PEER)),
        # eval
        Case(["eval", "--task", "no_such_task"], 2, ("'--task'", "'no_such_task'", "addition")),
        Case(["eval", "--task-config", "{bad"], 2, ("'--task-config'", "not valid JSON")),
        Case(["eval", "--task-config", "[3]"], 2, ("'--task-config'", "JSON object")),
        Case(["eval", "--task-config", '{"digits": 9}'], 2, ("'--task-config'", "digits")),
        Case(["eval", "--model", "./no/such/model"], 2, ("'--model'", "no model directory")),
        Case(["eval", "--model", f"{d}/empty"], 2, ("'--model'", "config.json")),
        Case(["eval", "--model", "my model"], 2, ("'--model'", "nor a hub id")),
        Case(["eval", "--device", "cuda:99"], 2, ("'--device'", "cuda:99")),
        Case(["eval", "--system-prompt", "Be brief."], 2, ("--chat-template auto",)),
        Case(["eval", "--adapter", f"{d}/no-adapter"], 2, ("'--adapter'", "does not exist")),
        # train-local
        Case(["train-local", "--lr", "-1"], 2, ("'--lr'", "-1")),
        Case(["train-local", "--save-adapter", f"{afile}/adapter"], 2, ("'--save-adapter'", "is a file")),
        Case(["train-local", "--report", f"{afile}/report.json"], 2, ("'--report'", "is a file")),
        Case(["train-local", "--group-size", "1"], 2, ("'--group-size'",)),
        # fetch-model and build-tiny
        Case(["fetch-model", "no-such-model"], 2, ("'no-such-model'", "smollm2-135m-instruct")),
        Case(["fetch-model", "smollm2-135m-instruct", "--out", f"{afile}/m"], 2, ("'--out'", "is a file")),
        Case(["build-tiny", "--out", f"{afile}/tiny"], 2, ("'--out'", "is a file")),
        # export
        Case(["export", "--out", f"{afile}/export"], 2, ("'--out'", "is a file")),
        # host
        Case(["host", "--run-id", "bad id"], 2, ("'--run-id'", "'bad id'")),
        Case(["host", "--run-id", "r", "--task", "nosuch"], 2, ("'--task'", "'nosuch'")),
        Case(["host", "--run-id", "r", "--private"], 2, ("--identity FILE",)),
        Case(["host", "--run-id", "r", "--web-port", str(busy_port)], 2, ("'--web-port'", "cannot listen")),
        Case(["host", "--run-id", "r", "--model", "/no/such/model"], 2, ("'--model'", "no model directory")),
        Case(["host", "--run-id", "r", "--info-file", f"{afile}/info.json"], 2, ("'--info-file'", "is a file")),
        Case(["host", "--run-id", "r", "--system-prompt", "é" * 1000, "--chat-template", "auto"], 2, ("4096",)),
        # invite
        Case(["invite", "--identity", f"{d}/nobody.id", "--run-id", "r"], 2, ("'--identity'", "no host identity")),
        Case(["invite", "--identity", junk_key, "--run-id", "r"], 2, ("'--identity'", "corrupt signing key")),
        Case(["invite", "--identity", host, "--run-id", "bad id"], 2, ("'--run-id'",)),
        Case([*invite, "--expires", "soon"], 2, ("'--expires'", "7d")),
        Case([*invite, "--name", "x" * 65], 2, ("'--name'", "64")),
        Case([*invite, "--revoke", "nope"], 2, ("'--revoke'", "--list")),
        Case([*invite, "--revoke", "0123456789abcdef"], 1, ("no invite '0123456789abcdef'", "--list")),
    ]


def run(case: Case) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in OUR_VARIABLES} | {"OMP_NUM_THREADS": "1", **case.env}
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "peer.cli", *case.argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )


def problems(case: Case, out: subprocess.CompletedProcess) -> list[str]:
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    found = []
    if out.returncode != case.code:
        found.append(f"exit {out.returncode}, not {case.code}")
    if "Traceback" in text:
        found.append("a traceback")
    if case.code and len(errors) != 1:
        found.append(f"{len(errors)} Error lines")
    found += [f"no {s!r} in the Error line" for s in case.says if not any(s in e for e in errors)]
    if case.code == 2 and TRANSFORMERS.search(out.stderr):
        found.append("transformers was imported before the error")
    if case.code == 2 and "joined run" in text:
        found.append("a swarm was joined before the error")
    return found


def test_bad_input_is_one_line_naming_the_option_before_anything_loads(files, busy_port):
    table = cases(files, busy_port)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, table))
    failures = []
    for case, out in zip(table, results, strict=True):
        if found := problems(case, out):
            text = out.stdout + out.stderr
            tail = [line for line in text.splitlines() if not line.startswith("import time:")][-4:]
            failures.append(f"hivegrpo {' '.join(case.argv)[:160]}: {'; '.join(found)}\n    " + "\n    ".join(tail))
    assert not failures, f"{len(failures)} of {len(table)} cases failed:\n" + "\n".join(failures)
