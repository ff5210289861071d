"""The local swarm of ``hivegrpo demo``: a host, a learner and rollout peers as real child processes on loopback.

Each child is the ``hivegrpo`` command a user would run (``python -m peer.cli host|learn|join``), in a session of
its own (a ^C at the terminal reaches only the demo, which then stops the children in order), with one torch
thread, its stderr in ``logs/NAME.log`` and its final ``--json`` summary in ``logs/NAME.json``. Stopping is by
SIGTERM (each role finishes its batch or update and leaves cleanly), then SIGKILL after a grace period, always by
the child's own PID. Rollout peers lower themselves to nice 19 once ready, with batches of 8 prompts (docs/demo.md
says why). The first learner and the rollout peers start beside the host (:mod:`peer.demo.prestart`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from peer.children import spawn
from peer.errors import UserError

LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-relay"]
LEARNER_STAGGER = 3.0  # s between starting the learners of a team
ROLLOUT_NICE = 19  # rollout peers use the CPU the learner leaves (on 2 cores the learner is the bottleneck; at
# nice 10 the learner's update still waited for a core ~10 % of the time, at 19 4-7 %: docs/demo.md)
# a peer swaps adapters between batches: smaller ones follow sooner; it lowers its priority once ready (joining at
# full priority: at nice 10 from the start, the rollout peers were ready ~5 s after the learner, which waited)
ROLLOUT_ARGS = ["--batch-size", "8", "--nice", str(ROLLOUT_NICE)]
PRESTART = "peer.demo.prestart"
PRESTART_NICE = 19  # a child started beside the host imports at the lowest priority: the host, awaited by all, first
STOP_GRACE = 60.0  # seconds a child gets to finish after SIGTERM


class Child:
    def __init__(
        self,
        name: str,
        argv: list[str],
        logs: Path,
        module: str = "peer.cli",
        session_nice: int = 0,
        forked: str | None = None,
    ):
        """``python -m MODULE ARGV``; ``forked``: instead, this process forks a child of that name that runs
        :func:`peer.demo.prestart.main` with ``argv`` (``module`` must then be :data:`PRESTART`)."""
        self.name = name
        self.log = logs / f"{name}.log"
        self.summary = logs / f"{name}.json"
        self._terminated = False
        if forked is not None:
            from peer.demo.prestart import fork

            self.process = fork(argv, self.log, self.summary, forked)
            return
        with open(self.summary, "w", opener=lambda path, flags: os.open(path, flags, 0o600)) as out:
            self.process = spawn(["-m", module, *argv], self.log, stdout=out, session_nice=session_nice)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def result(self) -> dict | None:
        """The child's ``--json`` summary, once it has exited and printed one."""
        try:
            text = self.summary.read_text().strip().splitlines()
            return json.loads(text[-1]) if text else None
        except (OSError, ValueError):
            return None

    def terminate(self) -> None:
        """SIGTERM, once: a second one can reach a child in its interpreter's shutdown and kill it mid-exit."""
        if self.alive and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, grace: float = STOP_GRACE) -> int:
        """SIGTERM, then after ``grace`` SIGKILL to the child's whole process group (its session, whose id is the
        child's PID: a child killed alone would leave its DHT process and p2pd behind); its exit code."""
        self.terminate()
        try:
            code = self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):  # nothing of the group left: the usual case
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait() if code is None else code


class LocalSwarm:
    """Start with :meth:`start`; :meth:`stop` ends rollout peers, then the learners, then the host.

    With ``learners`` > 1 they form one team (:mod:`peer.roles.learner.team.lead`), each on a credential of its own:
    the first leads, the others help; each writes its own ledger (``ledger``, then ``ledger-2.jsonl`` ... beside
    it), every one of them the whole lineage.
    """

    def __init__(
        self,
        root: Path,
        logs: Path,
        *,
        run_id: str,
        rollout_peers: int,
        ledger: Path,
        learners: int = 1,
        host_args: list[str] | None = None,
        learner_args: list[str] | None = None,
        rollout_args: list[list[str]] | None = None,
        module: str = "peer.cli",
    ):
        """``host_args``, ``learner_args`` and ``rollout_args`` (one list per rollout peer) are appended to the
        children's command lines (benchmarks use them: another model or task, a ledger per rollout peer);
        ``module`` is what each child runs with ``python -m`` (a benchmark's harness wraps the command line)."""
        self.module = module
        self.root, self.logs, self.run_id = root, logs, run_id
        self.rollout_count, self.ledger, self.learner_count = rollout_peers, ledger, learners
        self.host_args, self.learner_args = list(host_args or []), list(learner_args or [])
        self.rollout_args = [list(a) for a in rollout_args or []]
        self.host: Child | None = None
        self.learners: list[Child] = []
        self.rollouts: list[Child] = []
        self.info: dict = {}

    def start(self, timeout: float = 180.0) -> LocalSwarm:
        """Start the host, and beside it the first learner and the rollout peers (:mod:`peer.demo.prestart`: they
        import their libraries while the host starts, or are forked from this process once it has imported them,
        then take the host's address from its info file); once the host is up, the team's other learners,
        ``LEARNER_STAGGER`` s apart."""
        # not at the top: the package would import what it runs
        from peer.demo.prestart import CREDENTIAL, JOIN, ROLE_MODULES, can_fork

        self.logs.mkdir(parents=True, exist_ok=True)
        self.logs.chmod(0o700)  # the host's summary holds the learner credential, the logs the peers' addresses
        info_file = self.root / "info.json"
        host = ["host", "--run-id", self.run_id, "--cache-dir", str(self.root / "host"), *LOOPBACK]
        host += ["--learners", str(max(1, self.learner_count))]  # a credential admits one learner
        self.host = Child(
            "host", [*host, "--info-file", str(info_file), *self.host_args], self.logs, module=self.module
        )
        early = [str(info_file), str(timeout), self.module]
        forking = can_fork()
        if forking:  # while the host imports its own: once here for every early child (the demo needs them too)
            for command, count in (("learn", self.learner_count), ("join", self.rollout_count)):
                if count:
                    importlib.import_module(ROLE_MODULES[command])
            forking = can_fork()  # no import started a thread

        def early_child(name: str, argv: list[str]) -> Child:
            how = {"forked": f"hivegrpo-{argv[0]}"} if forking else {"session_nice": PRESTART_NICE}
            return Child(name, [*early, *argv], self.logs, module=PRESTART, **how)

        if self.learner_count:
            self.learners.append(early_child(_learner(0), self._learn(0, [JOIN], CREDENTIAL)))
        for i in range(self.rollout_count):
            extra = self.rollout_args[i] if i < len(self.rollout_args) else []
            self.rollouts.append(early_child(f"rollout-{i + 1}", self._join(f"rollout-{i + 1}", [JOIN], extra)))
        deadline = time.monotonic() + timeout
        while not info_file.exists():
            if not self.host.alive or time.monotonic() > deadline:
                raise UserError(
                    f"the demo's host did not start within {timeout:.0f} s (log {self.host.log}):\n{self.host.tail()}"
                )
            time.sleep(0.2)
        self.info = json.loads(info_file.read_text())
        for i in range(1, self.learner_count):
            time.sleep(LEARNER_STAGGER)  # a later learner then finds the first one leading, and helps it
            argv = self._learn(i, self._expand([JOIN]), self.info["learner_credentials"][i])
            self.learners.append(Child(_learner(i), argv, self.logs, module=self.module))
        return self

    def _learn(self, i: int, join: list[str], credential: str) -> list[str]:
        name = _learner(i)
        ledger = self.ledger if i == 0 else self.ledger.with_name(f"{self.ledger.stem}-{i + 1}.jsonl")
        learner = ["learn", "--run-id", self.run_id, *LOOPBACK, "--json", *join, "--learner-credential", credential]
        return [*learner, "--cache-dir", str(self.root / name), "--ledger", str(ledger), *self.learner_args]

    def _join(self, name: str, join: list[str], extra: list[str]) -> list[str]:
        rollout = ["join", "--run-id", self.run_id, *LOOPBACK, "--json", *join, "--cache-dir", str(self.root / name)]
        return [*rollout, "--identity", str(self.root / f"{name}.id"), *ROLLOUT_ARGS, *extra]

    def _expand(self, argv: list[str]) -> list[str]:
        from peer.demo.prestart import expand

        return expand(argv, self.info)  # the host's address and credential, known once it is up

    def add_rollout(self, name: str, extra: list[str] | None = None) -> Child:
        """Start one more rollout peer (after :meth:`start`), with ``extra`` arguments."""
        from peer.demo.prestart import JOIN

        child = Child(name, self._join(name, self._expand([JOIN]), extra or []), self.logs, module=self.module)
        self.rollouts.append(child)
        return child

    @property
    def learner(self) -> Child | None:
        """The first learner (the one that leads, unless it died)."""
        return self.learners[0] if self.learners else None

    @property
    def children(self) -> list[Child]:
        return [c for c in (*self.rollouts, *self.learners, self.host) if c is not None]

    def check(self) -> list[str]:
        """Raise if the host or every learner died; name the other peers that died (the swarm goes on without)."""
        live_learners = [c for c in self.learners if c.alive]
        for child in (self.host, *([] if live_learners else self.learners[:1])):
            if child is not None and not child.alive:
                raise UserError(
                    f"the demo's {child.name} exited with code {child.process.returncode} (log {child.log}):\n"
                    f"{child.tail()}"
                )
        return [c.name for c in (*self.rollouts, *self.learners) if not c.alive]

    def stop(self) -> dict[str, int]:
        """Stop every child that is still running, in order; their exit codes by name."""
        codes = {}
        for group in (self.rollouts, self.learners, [self.host]):
            live = [c for c in group if c is not None]
            for c in live:
                c.terminate()
            for c in live:
                codes[c.name] = c.stop()
        return codes


def _learner(i: int) -> str:
    """The name of a team's ``i``-th learner (from 0)."""
    return "learner" if i == 0 else f"learner-{i + 1}"


__all__ = ["Child", "LocalSwarm"]
