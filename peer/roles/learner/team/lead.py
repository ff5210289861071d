"""Several learners, one adapter lineage: a leader splits each update into shares, helpers compute theirs.

Protocol ``hivegrpo.team.v2`` (request/response over a P2P stream, :mod:`peer.network.rpc`), served by every
learner; only the one *leading* answers with work, the others redirect to it. A helper loops on one request::

    helper -> leader   {"op": "work", "version": v, "sha": s, "need_state": bool, "invite": ...}
    leader -> helper   {"steps": [...]}   the updates since v (each: version, parent, sha, size, the clipped
                                          gradient, the intake's delta, the ledger record)
                       {"state": {...}}   v/s is not in the leader's recent lineage, or the helper asked (it has
                                          just joined): the whole state (adapter, AdamW state, the intake's
                                          bans and used seqs)
                       {"task": {...}}    a share of the update in progress: groups (packed records) + signers
                       {"idle": true}     nothing within POLL_WAIT s: ask again
                       {"leader": id}     not leading: ask that one (None: nobody known)
                       {"refused": why}   this leader no longer takes this helper's work
    helper -> leader   {"op": "result", "task": id, "grads": bytes, "tokens": n, "stats": {...}}
                       ``tokens``: the helper's own count, compared but not used (see Trust)

Every answer carries ``members``: the leader, then its helpers in the order they came. When the leader is gone a
helper walks that list: the first one alive leads (every member holds the same adapter *and* AdamW state, because
each applied the same clipped gradients), so no version is lost and none goes backwards. For that, a leader with
helpers announces a version only once every active helper holds it (:meth:`Lead.holds`: a helper's work request
names the version it holds); a leader whose helpers all went silent asks them before it goes on alone — if one of
them leads now (this leader was frozen, or cut off), it follows that one.

**Trust.** Only admitted learners (:mod:`peer.network.admission`) are members, and even they are checked:

* *who, before what*: a call from a libp2p peer id that is not an admitted learner's is refused before a byte of
  its request is read (:meth:`Lead.precheck`, run in an executor: it may read the DHT). A private swarm's invite
  is in the request, so it is checked after reading — but only an admitted learner's request is read at all;
* *how much*: a request is at most :func:`request_limit` bytes — the largest request is a result, whose gradient
  is the size of the LoRA tensors — and at most ``REQUEST_CONTAINERS`` maps and arrays; answers (a state, steps)
  may be up to ``MAX_ANSWER`` bytes and the run's :func:`~.messages.answer_containers` maps and arrays, and come
  only from the leader the helper chose, an admitted learner;
* *what*: every request and answer is checked by a strict, bounded schema (:mod:`peer.roles.learner.team.messages`)
  before it is used; tensors travel as safetensors and the AdamW state as step counts + safetensors moments,
  loaded into this learner's own hyper-parameters (:func:`peer.roles.learner.update.optimizer_state_from_wire`), never
  ``torch.load``;
* *weights*: the leader weighs each share by the tokens it counts itself in the groups it assigned
  (:func:`peer.roles.learner.update.signal_tokens`); a helper's claimed count is only compared (``tokens_disagreed``);
* *bans*: a helper keeps the leader's used seqs (they stop replays whoever leads next) but does not take the
  leader's bans as its own. While it follows, its intake reads nothing (the leader picks every group), so the
  leader's bans need no effect there; it only keeps the most recent ``MAX_BANNED`` of them as *reported*
  (``leader_bans`` in its summary) and forgets them when it leads itself: its intake then judges every signer
  from what it verifies — a liar is caught again by the same checks, and costs no more than a fresh key would.
  An admitted but buggy or compromised leader can so never make its team ban honest producers for good. The
  learner's own bans (from when it led) persist, in its checkpoints too.

The leader side (:class:`Lead`) is touched by the learner's loop thread and by the handler on the blob service's
event loop; everything shared is under one lock. :mod:`peer.roles.learner.peer` drives both sides.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import Counter

from hivemind.p2p import PeerID

from peer.log import get_logger
from peer.network import rpc
from peer.roles.learner.team import messages
from peer.roles.learner.team.messages import KEEP_STEPS, MAX_ANSWER, MAX_MEMBERS
from peer.roles.learner.update import tensors_to_bytes

logger = get_logger(__name__)

PROTOCOL = "hivegrpo.team.v2"
REQUEST_SLACK = 64 << 10  # bytes a request carries besides a gradient (op, ids, invite, stats, msgpack framing)
REQUEST_CONTAINERS = 8  # maps and arrays in one request (a result has two: itself and its stats)
POLL_WAIT = 2.0  # s a work request waits for something to do
ACTIVE_FOR = 5.0  # s since its last request for a helper to be given shares
CALL_TIMEOUT = 15.0  # s for one call that asks for a state (a large answer)
WORK_TIMEOUT = 10.0  # s for a work request (it waits POLL_WAIT of it): a frozen leader is noticed this soon


def request_limit(gradient_bytes: int) -> int:
    """The largest request a leader reads: a result, whose gradient is ``gradient_bytes`` (the LoRA tensors' bytes)
    as safetensors — twice that (room for float32 gradients of half-precision tensors) — plus slack."""
    return 2 * gradient_bytes + REQUEST_SLACK


class Lead:
    """The leader's side of the team protocol (and, when not leading, the redirect to who is)."""

    def __init__(self, me: str, access=None, admitted=None, gradient_bytes: int = 0):
        self.me = me
        self.access = access  # a private swarm's Access: requests must carry a valid invite
        self.admitted = admitted  # the run's admitted learners: only they may call (peer.network.admission)
        self.request_limit = request_limit(gradient_bytes)  # gradient_bytes: the LoRA tensors' size in bytes
        self.leading = False
        self.leader_hint: str | None = None
        self.version, self.sha = -1, ""
        self.stats: Counter = Counter()
        self.results: queue.Queue = queue.Queue()
        self.snapshot_wanted = threading.Event()
        self._lock = threading.Lock()
        self._lineage: dict[int, str] = {}
        self._steps: dict[int, dict] = {}
        self._helpers: dict[str, list[float]] = {}  # peer -> [first seen, last seen]
        self._held: dict[str, int] = {}  # helper -> the version of this lineage it holds (its last work request)
        self.alone = True  # leading with no helper known: versions need nobody else to hold them
        self._refused: dict[str, str] = {}  # helper peer -> why its work is no longer taken
        self._tasks: dict[str, dict] = {}  # helper peer -> its share of the update in progress
        self._snapshot: dict | None = None
        self._ids = itertools.count()
        self.closed = False  # set before the handler is removed: waiting requests answer at once

    # --- the learner's loop ----------------------------------------------------------------------------------------

    def lead(self, version: int, sha: str) -> None:
        with self._lock:
            self.leading, self.leader_hint, self.alone = True, None, True
            self._lineage = {version: sha}
            self._steps, self._tasks, self._snapshot = {}, {}, None
            self.version, self.sha = version, sha

    def follow(self, leader: str | None) -> None:
        with self._lock:
            self.leading, self.leader_hint = False, leader
            self._tasks.clear()
            self._helpers.clear()

    def advance(self, step: dict) -> None:
        """The update that made ``step["version"]`` is done: helpers get it on their next request (its ``grads`` a
        list of tensors, serialized the first time a helper asks for the step)."""
        with self._lock:
            v = step["version"]
            self.version, self.sha = v, step["sha"]
            self._lineage[v], self._steps[v] = step["sha"], step
            for old in [k for k in self._lineage if k < v - KEEP_STEPS]:
                self._lineage.pop(old, None)
                self._steps.pop(old, None)
            self._tasks.clear()
            self._snapshot = None

    def holds(self, version: int) -> bool:
        """Whether ``version`` may be announced: every active helper holds it (or this leader has no helper)."""
        now = time.monotonic()
        with self._lock:
            active = [p for p, t in self._helpers.items() if now - t[1] < ACTIVE_FOR and p not in self._refused]
            if not active:
                return self.alone
            return all(self._held.get(p, -1) >= version for p in active)

    def silent(self) -> list[str]:
        """Helpers known to this leader that have not asked for work within ACTIVE_FOR s (oldest first)."""
        now = time.monotonic()
        with self._lock:
            helpers = self._helpers.items()
            quiet = [(t[0], p) for p, t in helpers if now - t[1] >= ACTIVE_FOR and p not in self._refused]
        return [p for _, p in sorted(quiet)]

    def release(self, gone: list[str]) -> None:
        """``gone`` (silent helpers that did not answer) are no longer members: lead alone unless others ask."""
        with self._lock:
            for p in gone:
                self._helpers.pop(p, None)
                self._held.pop(p, None)
            self.alone = all(p in self._refused for p in self._helpers)

    def helpers(self) -> list[str]:
        """The helpers to give shares to: asked within ACTIVE_FOR s, not refused, oldest first."""
        now = time.monotonic()
        with self._lock:
            live = [(t[0], p) for p, t in self._helpers.items() if now - t[1] < ACTIVE_FOR and p not in self._refused]
        return [p for _, p in sorted(live)]

    def assign(self, helper: str, groups: list[dict]) -> int:
        """Hand ``helper`` a share of the current update; returns the task id its result will carry."""
        task_id = next(self._ids)
        with self._lock:
            self._tasks[helper] = {"id": task_id, "version": self.version, "groups": groups}
        return task_id

    def withdraw(self, helper: str) -> None:
        with self._lock:
            self._tasks.pop(helper, None)

    def refuse(self, helper: str, why: str) -> None:
        with self._lock:
            self._refused[helper] = why
            self._tasks.pop(helper, None)

    def offer_snapshot(self, snapshot: dict) -> None:
        with self._lock:
            if snapshot["version"] == self.version:
                self._snapshot = snapshot
        self.snapshot_wanted.clear()

    # --- the handler (on the blob service's event loop) ------------------------------------------------------------

    def precheck(self, peer_id: PeerID) -> str | None:
        """Before a request is read (:func:`rpc.serve` runs it in an executor): None if ``peer_id`` may call, else
        why not. The libp2p peer id is authenticated; the admission binds it to a learner credential."""
        if self.admitted is None or self.admitted.admits_peer(str(peer_id)):
            return None
        with self._lock:
            self.stats["refused_unadmitted"] += 1
        return "not an admitted learner of this run: a team takes only learners its host admitted"

    async def handle(self, peer_id: PeerID, request: dict) -> dict:
        """One request (its caller passed :meth:`precheck`); a malformed one raises ProtocolError ("bad request")."""
        peer = str(peer_id)
        if self.access is not None:
            refused = self.access.check(request.get("invite"))
            if refused is not None:
                return {"error": f"not authorized ({refused}): this learner works with its swarm's peers only"}
        message = messages.parse_request(request)
        if isinstance(message, messages.Probe):
            with self._lock:
                return {"leading": self.leading, "leader": self.leader_hint, "version": self.version, "sha": self.sha}
        if isinstance(message, messages.Work):
            return await self._work(peer, message.version, message.sha, message.need_state)
        return self._result(peer, message)

    async def _work(self, peer: str, version: int, sha: str, need_state: bool) -> dict:
        deadline = time.monotonic() + POLL_WAIT
        with self._lock:
            if peer in self._refused:
                return {"refused": self._refused[peer]}
            now = time.monotonic()
            self._helpers.setdefault(peer, [now, now])[1] = now
            if self.leading:
                self.alone = False
                if self._lineage.get(version) == sha:
                    self._held[peer] = version
        while True:
            with self._lock:
                if not self.leading or self.closed:
                    return {"leader": self.leader_hint}
                helpers = [p for _, p in sorted((t[0], p) for p, t in self._helpers.items())]
                members = [self.me, *helpers][:MAX_MEMBERS]
                if need_state or self._lineage.get(version) != sha or version > self.version:
                    answer = None if self._snapshot is None else {"state": self._snapshot}
                    if answer is None:
                        self.snapshot_wanted.set()
                elif version < self.version:
                    steps = [self._steps.get(v) for v in range(version + 1, self.version + 1)]
                    if all(steps):
                        answer = {"steps": [_on_the_wire(step) for step in steps]}
                    else:
                        answer = None if self._snapshot is None else {"state": self._snapshot}
                        if answer is None:
                            self.snapshot_wanted.set()
                else:
                    task = self._tasks.pop(peer, None)
                    answer = None if task is None or task["version"] != version else {"task": task}
                now = time.monotonic()
                self._helpers.setdefault(peer, [now, now])[1] = now
            if answer is not None:
                self.stats[next(iter(answer))] += 1
                return {**answer, "members": members}
            if time.monotonic() > deadline:
                return {"idle": True, "members": members}
            await asyncio.sleep(0.01)

    def _result(self, peer: str, result: messages.Result) -> dict:
        stats = {} if result.stats is None else result.stats.dict()
        self.results.put((peer, result.task, result.grads, result.tokens, stats))
        return {"ok": True}


class TeamClient:
    """The helper's side: blocking calls to other learners through the blob service's event loop."""

    def __init__(self, blobs, invite: str | None, max_containers: int = messages.MAX_ANSWER_CONTAINERS):
        """``max_containers``: the maps and arrays an answer may hold (:func:`~.messages.answer_containers` of the
        run; by default the widest run's)."""
        self.blobs = blobs
        self.invite = invite
        self.max_containers = max_containers

    def _call(self, peer: str, request: dict, timeout: float = CALL_TIMEOUT) -> dict:
        request = {**request, "invite": self.invite}
        target = PeerID.from_base58(peer)

        async def go(p2p):
            return await rpc.call(
                p2p, target, PROTOCOL, request, timeout=timeout, limit=MAX_ANSWER, max_containers=self.max_containers
            )

        return self.blobs.run_coroutine(go, timeout + 5)

    def probe(self, peer: str, timeout: float = 5.0) -> dict:
        return messages.parse_probe_answer(self._call(peer, {"op": "probe"}, timeout))

    def work(self, leader: str, version: int, sha: str, need_state: bool = False) -> dict:
        """``need_state``: this learner has not taken the team's AdamW state yet (it just joined). The answer is
        checked (:func:`~peer.roles.learner.team.messages.parse_work_answer`): ProtocolError if malformed."""
        request = {"op": "work", "version": version, "sha": sha, "need_state": need_state}
        answer = self._call(leader, request, CALL_TIMEOUT if need_state else WORK_TIMEOUT)
        return messages.parse_work_answer(answer)

    def result(self, leader: str, task_id: int, grads: bytes, tokens: int, stats: dict) -> dict:
        request = {"op": "result", "task": task_id, "grads": grads, "tokens": tokens, "stats": stats}
        return messages.parse_result_answer(self._call(leader, request))


def serve(blobs, lead: Lead) -> None:
    """Register ``lead``'s handler on the blob service's P2P replica (the learner's peer id)."""

    async def go(p2p):
        await rpc.serve(
            p2p,
            PROTOCOL,
            lead.handle,
            limit=lead.request_limit,
            precheck=lead.precheck,
            max_containers=REQUEST_CONTAINERS,
        )

    blobs.run_coroutine(go, 30)


def unserve(blobs, lead: Lead) -> None:
    """Answer the requests waiting now (a helper then asks who leads), and remove the handler."""
    lead.follow(None)
    lead.closed = True

    async def go(p2p):
        await asyncio.sleep(0.1)  # the waiting requests see ``closed`` within 10 ms and answer
        await p2p.remove_binary_stream_handler(PROTOCOL)

    blobs.run_coroutine(go, 10)


def wins(a: tuple[int, str], b: tuple[int, str]) -> bool:
    """Whether leader ``a`` = (version, peer id) wins over leader ``b``: the higher version, then the smaller id."""
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


def _on_the_wire(step: dict) -> dict:
    """``step`` with its gradient as bytes, kept so (call with the lock held): serialized once, when a helper first
    needs it, not on the update's path."""
    if isinstance(step.get("grads"), list):
        step["grads"] = tensors_to_bytes(step["grads"])
    return step


__all__ = ["KEEP_STEPS", "PROTOCOL", "Lead", "TeamClient", "request_limit", "serve", "unserve", "wins"]
