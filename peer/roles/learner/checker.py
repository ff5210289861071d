"""The learner's log-prob spot checks in a child process, beside its updates (a learner on CPU).

A spot check recomputes a sampled group's behaviour log-probs under the adapter version the group claims: one
forward pass per version, which ran on the learner's loop between updates (7.7-11.5 s of the demo learner's 173 s;
docs/learner.md). A child forked once the learner has started holds the model (the base's pages stay shared with
the learner until either writes them; the LoRA tensors and activations are its own), receives each version's LoRA
tensors once and the groups to check, and answers each submission with its groups' verdicts, in order. The loop
hands checks over and collects verdicts without waiting, so the update goes on meanwhile; it waits on a verdict
only when the next update needs the groups a check holds.

The child runs in a session of its own at nice 5 (its threads and, where the kernel groups sessions for
scheduling, its autogroup): in the learner's session it would halve the update's weight against the other
sessions whenever both ran, and at nice 0 it would take the update's core as often as it got its own. The
hand-over is a thread of the learner: a version's LoRA tensors (~280 KB on the bundled model) do not fit the pipe's
buffer while the child checks the previous submission, and the loop must not wait for that.

Only on CPU: a process cannot be forked once CUDA is initialised (a GPU learner checks on its loop, as before).
A child that dies is said once, and the learner checks on its loop from then on; the groups it held go back to
the intake's queue of checks. The pipe is a socketpair made before the fork: its only two ends are the learner and
its own child, so unpickling there is safe (nothing from the network reaches it; the groups were parsed and
verified by the learner first).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import deque

import torch

from peer.children import enter_helper, fork_helper, receive_message, send_message, set_session_nice
from peer.log import get_logger

logger = get_logger(__name__)

CHECK_NICE = 5  # the checking process's nice value, and its session's (see the module docstring)


class CheckerGone(RuntimeError):
    """The checker child ended unasked (or its pipe broke)."""


class Checker:
    """Spot checks in a child: :meth:`submit` a version's groups, :meth:`results` returns what was answered."""

    def __init__(self, model, spec, check):
        self._process, self._conn = fork_helper(_child, (model, spec, check), "spot-checker")
        self._held: set[tuple[int, str]] = set()  # (version, sha256) of the LoRA tensors the child holds
        self._waiting: deque = deque()  # (what it carried, its groups) of each submission not answered, in order
        self._outbox: queue.Queue = queue.Queue()
        self._broken: BaseException | None = None  # why the hand-over thread could not send
        self._sender = threading.Thread(target=self._send, name="spot-check-sender", daemon=True)
        self._sender.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def in_flight(self) -> int:
        """Submissions not answered yet."""
        return len(self._waiting)

    @property
    def groups_in_flight(self) -> int:
        """Groups of the submissions not answered yet (each submission carried its groups' list)."""
        return sum(n for _, n in list(self._waiting))

    def submit(self, version: tuple[int, str], tensors: list[torch.Tensor], groups: list, keep_from: int, carried):
        """Check ``groups`` (GroupRecords of adapter ``version``, a ``(number, sha256)``: a learner that takes a
        leader's state holds other tensors under the same numbers; its LoRA tensors are ``tensors``); the child
        forgets versions numbered below ``keep_from``. ``carried`` comes back with the verdicts. Raises
        CheckerGone."""
        if self._broken is not None:
            raise CheckerGone(f"the spot-check process {self.pid} is gone ({self._broken})")
        send = None if version in self._held else [t.detach().cpu().numpy().copy() for t in tensors]
        self._held = {v for v in self._held if v[0] >= keep_from} | {version}
        self._waiting.append((carried, len(groups)))
        self._outbox.put((version, send, groups, keep_from))

    def _send(self) -> None:
        """The hand-over thread: each submission to the child, in order (a full pipe blocks this thread only)."""
        while True:
            message = self._outbox.get()
            try:
                send_message(self._conn, message)
            except (OSError, ValueError) as e:
                self._broken = e
                return
            if message is None:
                return

    def results(self, timeout: float = 0.0) -> list[tuple[object, list]]:
        """``(carried, verdicts)`` of each submission answered since the last call, waiting up to ``timeout`` s for
        the first one. Raises CheckerGone (the submissions not answered are :meth:`unanswered`), or RuntimeError
        with what a check raised in the child."""
        out = []
        if self._broken is not None:
            raise CheckerGone(f"the spot-check process {self.pid} is gone ({self._broken})")
        try:
            while self._waiting and self._conn.poll(0.0 if out else timeout):
                verdicts, error = receive_message(self._conn)
                carried, _ = self._waiting.popleft()
                if error is not None:
                    raise RuntimeError(f"a spot check failed in the checking process: {error}")
                out.append((carried, verdicts))
        except (EOFError, OSError) as e:
            raise CheckerGone(
                f"the spot-check process {self.pid} stopped unasked (exit code {self._process.exitcode})"
            ) from e
        return out

    def unanswered(self) -> list:
        """What the submissions not answered carried (once the child is gone), oldest first."""
        waiting, self._waiting = list(self._waiting), deque()
        return [carried for carried, _ in waiting]

    def close(self, timeout: float = 10.0) -> None:
        self._outbox.put(None)
        self._sender.join(timeout)
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
        self._conn.close()


def _child(conn, parent_end, model, spec, check) -> None:
    """Answer each ``(version, tensors or None, groups, keep_from)`` with ``(verdicts, None)``, or ``(None, error)``
    when the check raised."""
    from peer.model.adapter import lora_parameters
    from peer.roles.learner.verify import check_logprobs_many

    enter_helper(parent_end, "hivegrpo-check")
    with contextlib.suppress(OSError):
        os.setsid()  # a session (and autogroup) of its own, niced: see the module docstring
        set_session_nice(CHECK_NICE)
    os.nice(CHECK_NICE)
    torch.set_num_threads(1)
    model.eval()
    params = lora_parameters(model)
    held: dict[tuple[int, str], list[torch.Tensor]] = {}
    loaded = None  # the version whose tensors the model holds now
    try:
        while True:
            message = receive_message(conn)
            if message is None:
                break
            version, tensors, groups, keep_from = message
            if tensors is not None:
                held[version] = [torch.from_numpy(t) for t in tensors]
            for v in [v for v in held if v[0] < keep_from and v != version]:
                del held[v]
            try:
                if loaded != version:
                    with torch.no_grad():
                        for p, t in zip(params, held[version], strict=True):
                            p.copy_(t)
                    loaded = version
                answer = (check_logprobs_many(model, groups, spec, check=check), None)
            except Exception as e:  # said to the parent, which raises it as its own check would have
                answer = (None, f"{type(e).__name__}: {e}")
            send_message(conn, answer)
    except (EOFError, OSError):
        return  # the parent is gone


__all__ = ["Checker", "CheckerGone"]
