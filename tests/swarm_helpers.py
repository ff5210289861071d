"""Helpers for tests that run peers as real processes on loopback (the fixtures are in conftest.py)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-relay"]


class Procs:
    """Child processes of one test, each logging to a file; stopped (TERM, then KILL) by PID at the end."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.groups: set[int] = set()  # process groups of new_session processes
        self.frozen: set[int] = set()

    def start(self, name: str, *args: str, new_session: bool = False) -> subprocess.Popen:
        """``python -m peer.cli ARGS`` (the ``hivegrpo`` command)."""
        return self.start_argv(name, ["-m", "peer.cli", *args], new_session=new_session)

    def start_argv(self, name: str, argv: list[str], new_session: bool = False) -> subprocess.Popen:
        """``python ARGV`` with stdout piped and stderr to ``<name>.log``; ``new_session``: in a process group of
        its own (with its DHT process and libp2p daemon), so :meth:`kill_group` ends all of it like a machine dying."""
        log = self.root / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        with open(log, "w") as f:
            p = subprocess.Popen(
                [sys.executable, *argv],
                stdout=subprocess.PIPE,
                stderr=f,
                text=True,
                env=env,
                start_new_session=new_session,
            )
        self.procs.append((p, log))
        if new_session:
            self.groups.add(p.pid)
        return p

    def kill_group(self, p: subprocess.Popen) -> None:
        """SIGKILL a process started with ``new_session=True`` and everything in its group, then reap it."""
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)

    def freeze(self, p: subprocess.Popen) -> None:
        """SIGSTOP a ``new_session=True`` process with its DHT process and libp2p daemon: a machine that hangs."""
        os.killpg(p.pid, signal.SIGSTOP)
        self.frozen.add(p.pid)

    def thaw(self, p: subprocess.Popen) -> None:
        os.killpg(p.pid, signal.SIGCONT)
        self.frozen.discard(p.pid)

    def log(self, p: subprocess.Popen) -> str:
        return next(log for q, log in self.procs if q is p).read_text()

    def stop_all(self) -> None:
        for pgid in self.frozen:  # a stopped process would never act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
        for p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _ in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pgid in self.groups:  # what a group leader left behind is no longer this process's child
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def wait_until(predicate, what: str, timeout: float = 90.0, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a process exited with {p.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout}s")


def model_copy(tmp_path: Path, name: str = "tiny-copy") -> Path:
    from peer.model.loading import bundled_path

    folder = tmp_path / name
    shutil.copytree(bundled_path(), folder)
    return folder


def start_host(
    procs: Procs, tmp_path: Path, run_id: str, *args: str, name: str = "host", new_session: bool = False
) -> tuple[subprocess.Popen, dict]:
    """``hivegrpo host`` for ``run_id``; returns the process and its info file's contents once written."""
    info_file = tmp_path / f"{run_id}-{name}-info.json"
    host = procs.start(
        name,
        "host",
        "--run-id",
        run_id,
        "--cache-dir",
        str(tmp_path / "host"),
        "--info-file",
        str(info_file),
        *args,
        *LOOPBACK,
        new_session=new_session,
    )
    wait_until(info_file.exists, "the host's info file", procs=[host])
    return host, json.loads(info_file.read_text())


def join_args(info: dict) -> list[str]:
    """The ``--run-id``, ``--coordinator`` and ``--initial-peers`` options the host printed, plus loopback."""
    peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
    return ["--run-id", info["run_id"], "--coordinator", info["coordinator"], *peers, *LOOPBACK]


def learn_args(info: dict) -> list[str]:
    """:func:`join_args` and the learner credential the host's learn line carries."""
    return [*join_args(info), "--learner-credential", info["learner_credential"]]


def read_ledger(path: Path) -> list[dict]:
    """A learner's ``--ledger`` lines (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def fingerprint(identity: Path) -> str:
    """Make the signing key a peer started with ``--identity identity`` will use, and name it (16 hex)."""
    from hivemind.dht.crypto import RSASignatureValidator

    from peer.network.swarm import load_signing_key
    from peer.protocol import key_fingerprint

    public = RSASignatureValidator(load_signing_key(str(identity))).local_public_key[len(b"[owner:") : -1]
    return key_fingerprint(public)


def status(run_id: str, maddrs: list[str], *extra: str) -> dict:
    """``hivegrpo status --json`` as a user runs it, through any of ``maddrs``."""
    peers = [a for m in maddrs for a in ("--initial-peers", m)]
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "status", "--run-id", run_id, *peers, *LOOPBACK, "--json", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)
