"""The rollout peer's publisher: scores sampled batches and makes their bucket entries in a child process, stores
the entries from the peer's own process.

Why a process: the sampler's decode loop gives the GIL up around every torch kernel, and whatever Python another
thread of its process runs meanwhile (the task's reward, the records, pydantic's validation, msgpack) holds the
next kernel up; on a small model the loop is mostly such gaps. A child has a GIL of its own (docs/rollout.md,
"Measured"). It is forked once the peer has started, so it inherits the task, the tokenizer, the run's spec and
the keys, and only the batches travel to it; it never touches the DHT. Back come the entries, plain values ready
to store, and a thread of this process stores them (one DHT call per gathered run: a few a second).

``prepare(sampled) -> list[GroupRecord]`` scores one batch and ``store.entries_of(groups)`` makes the entries, both
in the child; ``store.store_entries(entries)`` runs here. A ``prepare`` that raises (a task whose reward raises)
stops publishing: the error comes back and :meth:`Publisher.check` raises it at the sampler's next batch.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.children import enter_helper, fork_helper, receive_message, send_message
from peer.log import get_logger
from peer.model.sampling import Completions

logger = get_logger(__name__)

MAX_GATHERED_GROUPS = 64  # one bucket entry holds at most 64 groups
_FLUSH = "flush"  # to the child: stop gathering, prepare what came


@dataclass
class Sampled:
    """A sampled batch on its way to the publisher: everything its records need, fixed when it was sampled."""

    batch: Completions | None
    examples: list
    seqs: range
    version: int
    sha: str
    linger: float = 0.0  # seconds the child gathers the batches that follow this one into the same store

    def __getstate__(self) -> dict:
        # tensors as numpy arrays: pickled ~10x faster than torch's own reduction, and no shared-memory handles
        state = dict(self.__dict__)
        if self.batch is not None:
            state["batch"] = {k: v.numpy() for k, v in vars(self.batch).items()}
        return state

    def __setstate__(self, state: dict) -> None:
        if state["batch"] is not None:
            state["batch"] = Completions(**{k: torch.from_numpy(v) for k, v in state["batch"].items()})
        self.__dict__.update(state)


class Publisher:
    """Publishes sampled batches through a child process; a full queue (``max_queued`` batches not yet stored)
    blocks the sampler (backpressure). The child gathers what arrives within ``linger`` seconds (up to 64 groups)
    into one store: fewer, fuller entries cost every DHT node less validation. ``linger`` is a number or a function
    asked at each hand-over (the batch carries its answer to the child)."""

    def __init__(self, store, max_queued: int, prepare, linger: float | Callable[[], float] = 0.0):
        self.store = store
        self.max_queued = max_queued
        self.published = 0
        self.failed = 0
        self.prepare_seconds = 0.0
        self.last_error: str | None = None
        self.error: BaseException | None = None
        self._pending = 0  # batches handed over, not yet stored (or failed)
        self._closing = False
        self._done = threading.Condition()
        self._send_lock = threading.Lock()
        self._linger = linger if callable(linger) else (lambda: linger)
        self._process, self._conn = fork_helper(_child, (prepare, store.entries_of), "group-publisher")
        self._thread = threading.Thread(target=self._receive, name="group-publisher", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def put(self, sampled: Sampled) -> None:
        """Hand a batch over; blocks while ``max_queued`` batches are not yet stored."""
        self.check()
        with self._done:
            while self._pending >= self.max_queued and self._thread.is_alive():
                self._done.wait()
            self._pending += 1
        self.check()
        sampled.linger = self._linger()
        self._send(sampled)

    def check(self) -> None:
        """Raise what stopped the publishing, if anything did."""
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        """Block until every batch handed over has been stored (or has failed); the child stops gathering."""
        if self._thread.is_alive():
            self._send(_FLUSH)
        with self._done:
            while self._pending and self._thread.is_alive():
                self._done.wait()

    def close(self, timeout: float = 60.0) -> None:
        """Publish what was handed over, then stop the child and the thread (idempotent)."""
        self._closing = True
        if self._thread.is_alive():
            with contextlib.suppress(OSError, ValueError), self._send_lock:
                send_message(self._conn, None)
            self._thread.join(timeout)
        self._process.join(timeout if self._process.exitcode is None else 0)
        if self._process.exitcode is None:
            logger.warning("the group publisher did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _send(self, message) -> None:
        try:
            with self._send_lock:
                send_message(self._conn, message)
        except (OSError, ValueError):  # the child is gone: _receive says why
            self._thread.join(5.0)
            self.check()
            raise

    def _receive(self) -> None:
        """Store what the child prepared, as it comes; when the child ends, give up on what it still held."""
        while True:
            try:
                message = receive_message(self._conn)
            except (EOFError, OSError):
                break
            if message is None:  # the child's answer to close(): everything was answered before it
                break
            batches, entries, groups, seconds, error, failure = message
            self.prepare_seconds += seconds
            if error is not None and self.error is None:
                self.error = error
            try:
                if failure is not None:
                    raise RuntimeError(failure)
                if entries:
                    self.store.store_entries(entries)
                    self.published += groups
            except Exception as e:  # the network boundary: count it, say it, keep going
                self.failed += groups
                self.last_error = str(e)
                logger.warning("could not publish %d group(s): %s", groups, e)
            with self._done:
                self._pending -= batches
                self._done.notify_all()
        self._process.join(5.0)
        with self._done:
            if not self._closing and self.error is None:
                self.error = RuntimeError(
                    f"the group publisher (process {self._process.pid}) stopped unasked, exit code "
                    f"{self._process.exitcode}, with {self._pending} sampled batch(es) not published; restart the "
                    "peer (the groups it published before are in the swarm)"
                )
            self._pending = 0
            self._done.notify_all()


def _child(conn, parent_end, prepare, make_entries) -> None:
    """The child's loop: gather batches for up to the first one's ``linger`` s, score them, make their entries, send
    them back."""
    enter_helper(parent_end, "hivegrpo-publis")
    torch.set_num_threads(1)
    broken = False  # once a batch's scoring raised, nothing more is scored
    try:
        while True:
            message = receive_message(conn)
            if message is None:
                break
            batches = [] if isinstance(message, str) else [message]
            deadline, stop = time.monotonic() + (message.linger if batches else 0.0), False
            while batches and sum(len(b.seqs) for b in batches) < MAX_GATHERED_GROUPS:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    break
                message = receive_message(conn)
                if message is None or isinstance(message, str):  # close or flush: no more gathering
                    stop = message is None
                    break
                batches.append(message)
            if batches:
                answer = _prepare(batches, None if broken else prepare, make_entries)
                broken = broken or answer[4] is not None
                send_message(conn, answer)
            if stop:
                break
        send_message(conn, None)
    except (EOFError, OSError):
        return  # the parent is gone


def _prepare(batches: list, prepare, make_entries) -> tuple:
    """``(batches, entries, groups, seconds, error, failure)`` for the parent: ``error`` stops the peer (a
    broken task), ``failure`` only these groups (they could not be made into entries). ``prepare=None``: the
    batches are answered unscored (an earlier one broke)."""
    groups, error, failure, entries = [], None, None, []
    start = time.perf_counter()
    for sampled in batches if prepare is not None else ():
        try:
            groups += prepare(sampled)
        except Exception as e:  # a broken task: the sampler stops on it
            error = _portable(e)
            break
    try:
        entries = make_entries(groups) if groups else []
    except Exception as e:
        failure = str(e)
    return len(batches), entries, len(groups), time.perf_counter() - start, error, failure


def _portable(error: Exception) -> Exception:
    """The exception itself if it survives pickling (tried on its own bytes), else a RuntimeError saying what it
    was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


__all__ = ["Publisher", "Sampled"]
