"""Peers as real processes on loopback: started, watched and stopped by PID (the fixtures are in conftest.py)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from peer.children import spawn
from tests.helpers.waiting import wait_until

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
        p = spawn(argv, log, new_session=new_session, env={"HF_HUB_OFFLINE": "1"})
        p.log_path = log  # where wait_until finds its log if it dies
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
        return p.log_path.read_text()

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
    wait_until(info_file.exists, "the host's info file", watched_processes=[host])
    return host, json.loads(info_file.read_text())


def join_args(info: dict) -> list[str]:
    """The ``--run-id``, ``--coordinator`` and ``--initial-peers`` options the host printed, plus loopback."""
    peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
    return ["--run-id", info["run_id"], "--coordinator", info["coordinator"], *peers, *LOOPBACK]


def learn_args(info: dict, learner: int = 0) -> list[str]:
    """:func:`join_args` and the learner credential learn line ``learner`` carries (a host started with
    ``--learners N`` prints N, each admitting one key)."""
    return [*join_args(info), "--learner-credential", info["learner_credentials"][learner]]


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


def routing_table(swarm) -> set[str]:
    """The peer ids in ``swarm``'s DHT routing table, as its DHT process holds it now."""
    return swarm.dht.run_coroutine(_routing_table)


async def _routing_table(_dht, node) -> set[str]:
    return {peer_id.to_base58() for peer_id in node.protocol.routing_table.uid_to_peer_id.values()}


def know_each_other(swarms) -> bool:
    """Whether every one of ``swarms`` has each of the others in its routing table."""
    ids = {str(s.peer_id) for s in swarms}
    return all(ids - {str(s.peer_id)} <= routing_table(s) for s in swarms)


def exit_summary(proc: subprocess.Popen) -> dict:
    """The ``--json`` summary a peer prints last, once it exits (with 0: else the end of its log is the failure)."""
    out, _ = proc.communicate(timeout=90)
    log = getattr(proc, "log_path", None)
    assert proc.returncode == 0, log.read_text()[-3000:] if log is not None else f"exit code {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])
