"""A learner's part in its team (:mod:`peer.roles.learner.team.lead`): finding the leader, leading or helping, taking
over.

:class:`Teamwork` belongs to one :class:`~peer.roles.learner.peer.LearnerPeer` and works on its model, optimizer and
intake (``self.peer``): the learner's loop asks it who leads (:attr:`Teamwork.leader`, None when this learner
does), lets it run a helper's turn (:meth:`Teamwork.help_once`), and, leading, has it compute an update's
gradient in shares (:meth:`Teamwork.gradient`) and hand the step made to the helpers (:meth:`Teamwork.stepped`).
See docs/learner.md, "Several learners".
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter, OrderedDict

import torch

from peer.errors import UserError
from peer.log import get_logger
from peer.model.adapter import adapter_to_bytes, load_adapter_bytes, lora_parameters, sha256_hex
from peer.network.rpc import ProtocolError
from peer.protocol import GroupRecord, pack, unpack
from peer.protocol.limits import MAX_BANNED
from peer.roles.learner.intake import FORGET_EVERY, FORGET_MARGIN, Accepted
from peer.roles.learner.record import VersionRecord
from peer.roles.learner.team import lead as team
from peer.roles.learner.team import messages
from peer.roles.learner.update import (
    Share,
    apply_gradient,
    batch_tensors,
    combine,
    signal_tokens,
    tensors_from_bytes,
    tensors_to_bytes,
)
from peer.run.adapters import announcements

logger = get_logger("hivegrpo.roles.learner")  # one log for the learner, as a user reads it

RIVAL_CHECK_EVERY = 5.0  # s between a leader's looks for another learner leading a lineage of its own
TAKEOVER_WAIT = 10.0  # s a helper waits for the next member to notice that the leader is gone
HELPER_MIN_WAIT = 1.0  # s the leader waits at least for its helpers' gradients ...
HELPER_WAIT_FACTOR = 3.0  # ... or this many times its own share's time; a late share is computed by the leader
HELPER_PROBATION = 2  # a helper's first results are all recomputed by the leader (then: check_rate of them)
GRADIENT_TOLERANCE = 1e-3  # largest difference of a helper's gradient from the leader's, relative to its size
GATE_STALL = 3.0  # s a version may wait for the helpers to hold it before the leader asks them what is going on


class Teamwork:
    """See the module docstring; :meth:`start` once the learner holds its adapter and optimizer state."""

    def __init__(self, peer):
        self.peer = peer
        self.me = ""
        self.lead: team.Lead | None = None
        self.client: team.TeamClient | None = None
        self.leader: str | None = None  # the learner this one helps (None: it leads)
        self.members: list[str] = []  # the team as the leader last said, leader first
        self.counts: Counter = Counter()
        self._helper_results: Counter = Counter()  # helper -> results received (its first ones are all checked)
        self._rng = random.Random()
        self._failed_calls = 0
        self._deposed = False  # it led, and a helper of its took over: its own newer versions give way
        self._synced = False  # holds the team's AdamW state (from a state, or by having led)
        self._next_rival_check = 0.0
        self._rival: tuple[int, str] | None = None  # (version, peer id) of a learner leading a better lineage
        self._looking: threading.Thread | None = None  # the thread of the current look for such a learner
        self._next_team_check = 0.0
        self._unreachable: dict[str, float] = {}  # learner -> until when not to probe it again
        self.leader_bans: OrderedDict[str, str] = OrderedDict()  # bans the leader reported (signer hex -> why)

    def start(self, closers) -> None:
        """Serve the team protocol, then lead or help whoever leads."""
        s = self.peer.session
        self.me = str(s.swarm.peer_id)
        gradient_bytes = sum(p.numel() * p.element_size() for p in lora_parameters(s.model))
        self.lead = team.Lead(self.me, s.swarm.access, s.admitted, gradient_bytes)
        remembered = s.spec.staleness.tau_max + 1 + FORGET_MARGIN + FORGET_EVERY  # the versions ``used`` keeps
        budget = messages.answer_containers(s.spec.groups_per_version, remembered)
        self.client = team.TeamClient(s.blobs, s.blobs.invite, budget)
        team.serve(s.blobs, self.lead)
        closers.add(lambda: team.unserve(s.blobs, self.lead))
        leader = self.find_leader()
        if leader is None:
            self.take_lead("no other learner leads this run")
        else:
            self.follow(leader)

    def leader_turn(self) -> None:
        """What a leader does besides updating: a helper wants the state, its helpers went silent (this leader
        may have been frozen or cut off while one of them took over), another learner may lead too."""
        if self.lead.snapshot_wanted.is_set():
            self.lead.offer_snapshot(self.peer.state.snapshot())
        if time.monotonic() >= self._next_team_check and not self.lead.alone:
            if not self.lead.helpers():
                self.check_team(self.lead.silent())
            elif self.peer.announcer.blocked_for() > GATE_STALL:  # they ask for work but do not take the versions
                self.check_team(self.lead.helpers() + self.lead.silent())
            if self.leader is not None:
                return
        rival, self._rival = self._rival, None
        if rival is not None and team.wins(rival, (self.peer.session.version, self.me)):
            logger.warning("learner %s leads another lineage, at v%d: following it", rival[1], rival[0])
            self.follow(rival[1])
            return
        if time.monotonic() >= self._next_rival_check and (self._looking is None or not self._looking.is_alive()):
            self.check_rivals()

    def check_team(self, members: list[str]) -> None:
        """The helpers went silent, or do not take this leader's versions: follow one of ``members`` that leads
        now; forget those that do not answer; the others still help this learner."""
        self._next_team_check = time.monotonic() + 1.0
        gone = []
        for member in members:
            self._unreachable.pop(member, None)
            answer, leader, _ = self._who_leads(member)
            if answer is None:
                gone.append(member)
                continue
            if leader is None:
                continue  # alive, and (still) helping this learner: it will ask again
            logger.warning("learner %s leads the team now (this one was cut off or frozen): following it", leader)
            self.counts["deposed"] += 1
            self.follow(leader, deposed=True)
            return
        if gone:
            logger.info("helper(s) %s gone: leading without them", ", ".join(gone))
            self.lead.release(gone)

    def summary(self) -> dict:
        return {
            "leading": self.leader is None,
            "leader": self.leader or self.me,
            "members": len(self.members),
            "leader_bans": len(self.leader_bans),
            **{k: int(v) for k, v in sorted(self.counts.items())},
            **{f"served_{k}": int(v) for k, v in sorted(self.lead.stats.items())},
        }

    def heartbeat_stats(self) -> dict[str, float]:
        leading = self.leader is None
        return {"leading": 1.0 if leading else 0.0, "helpers": float(len(self.lead.helpers())) if leading else 0.0}

    # --- leading: an update in shares ------------------------------------------------------------------------------

    def gradient(self, chosen: list[Accepted]) -> tuple[Share | None, dict]:
        """The update's gradient over ``chosen``: a share for each helper, the rest here; and what sharing cost."""
        c = self.peer.config
        t0 = time.perf_counter()
        helpers = self.lead.helpers()
        parts = _split(chosen, len(helpers) + 1)
        tasks: dict[int, tuple[str, list[Accepted], int]] = {}  # task id -> helper, its groups, their tokens
        for helper, part in zip(helpers, parts[1:], strict=True):
            if part:
                groups = [{"owner": a.owner, "group": pack(a.group)} for a in part]
                tasks[self.lead.assign(helper, groups)] = (helper, part, self.tokens(part))
        shares = [self.peer.share(parts[0])]
        own_seconds = time.perf_counter() - t0
        received = self.collect(tasks, time.monotonic() + max(HELPER_MIN_WAIT, HELPER_WAIT_FACTOR * own_seconds))
        waited = time.perf_counter() - t0 - own_seconds
        for task_id, (helper, part, _) in tasks.items():
            share = received.get(task_id)
            if share is None:
                self.lead.withdraw(helper)
                self.counts["shares_late"] += 1
                share = self.peer.share(part)
            elif self._helper_results[helper] <= HELPER_PROBATION or self._rng.random() < c.check_rate:
                share = self.check_helper(helper, part, share)
            shares.append(share)
            self._helper_results[helper] += 1
        cost = {"helpers": len(tasks)}
        if tasks:  # what sharing cost: the leader's own share, then the wait for (or recomputing of) the others'
            cost |= {"share_seconds": round(own_seconds, 4), "wait_seconds": round(waited, 4)}
        return combine(shares), cost

    def tokens(self, part: list[Accepted]) -> int:
        """What a share of ``part`` weighs in :func:`combine`: counted here, from the groups (as the helper would)."""
        s = self.peer.session
        return signal_tokens(batch_tensors(part, s.version, s.spec, self.peer.pad_id(), torch.device("cpu")))

    def stepped(
        self, chosen: list[Accepted], grads, blob: bytes, parent: str, record: VersionRecord, delta: dict
    ) -> None:
        """Version ``record.version`` is made (``delta``: the intake's change): helpers get its step on their next
        request."""
        self.lead.advance(
            {
                "version": record.version,
                "parent": parent,
                "sha": record.sha256,
                "size": len(blob),
                # kept in host memory (no copy on a CPU: a GPU's would hold KEEP_STEPS gradients), serialized
                # when a helper first asks for this step (most steps, none does)
                "grads": [g.detach().cpu() for g in grads],
                "intake": delta,
                "record": dict(record.to_json(), ids=[list(a.id) for a in chosen]),
            }
        )

    def find_leader(self) -> str | None:
        """The leader of the run's learners (the best one if several lead), or None: the learners announcing adapters
        and those with a heartbeat are asked, twice a second apart (a record may not have reached this peer yet)."""
        from peer.network.heartbeat import live_peers

        s = self.peer.session
        for attempt in range(2):
            others = {r.learner for _, r in announcements(s.swarm, s.admitted) if r.version > 0}
            others |= {
                p.record.peer_id
                for p in live_peers(s.swarm, "learner")
                if s.admitted.admits(p.owner, p.record.peer_id)
            }
            others.discard(self.me)
            best: tuple[int, str] | None = None
            for peer in sorted(others):
                _, leader, said = self._who_leads(peer)
                if leader is None or not isinstance(said.get("version"), int):
                    continue
                if best is None or team.wins((said["version"], leader), best):
                    best = (said["version"], leader)
            if best is not None:
                if s.version > best[0]:  # a strictly newer version (a checkpoint); the same one is the leader's
                    return None  # this learner holds a newer version (a checkpoint): it leads, the other follows it
                return best[1]
            if attempt == 0 and others:
                self.peer.stop_event.wait(1.0)
                self._unreachable.clear()  # a first dial can fail before this peer knows the other's addresses
        return None

    def _who_leads(self, member: str, *not_these: str) -> tuple[dict | None, str | None, dict | None]:
        """Ask ``member`` who leads: its answer (None: gone), the learner that leads by its word (``member`` itself,
        or the leader it names once that one confirms; never this learner or one of ``not_these``; None: nobody it
        knows), and that leader's own answer."""
        answer = self._probe(member)
        if answer is None:
            return None, None, None
        if answer.get("leading"):
            return answer, member, answer
        hint = answer.get("leader")
        if isinstance(hint, str) and hint not in (self.me, member, *not_these):
            confirmed = self._probe(hint)
            if confirmed is not None and confirmed.get("leading"):
                return answer, hint, confirmed
        return answer, None, None

    def _probe(self, peer: str) -> dict | None:
        """``peer``'s answer to a probe; None if it is not an admitted learner (a stranger's answer, e.g. "leading",
        must never be followed), unreachable or not answering."""
        if self._unreachable.get(peer, 0) > time.monotonic() or not self.peer.session.admitted.admits_peer(peer):
            return None
        try:
            return self.client.probe(peer)
        except Exception as e:  # not a learner (the host), gone, or unreachable: not a leader to follow
            logger.debug("probing learner %s: %s", peer, e)
            self._unreachable[peer] = time.monotonic() + 60.0
            return None

    def take_lead(self, why: str) -> None:
        s = self.peer.session
        self.lead.lead(s.version, s.sha)
        self.leader, self.members, self._synced = None, [self.me], True
        self.leader_bans.clear()  # the last leader's decisions: this learner's intake judges for itself now
        self.peer.state.bans_recorded = self.peer.intake.bans_made
        self._next_rival_check, self._rival = time.monotonic() + RIVAL_CHECK_EVERY, None
        if self.counts["led"] or self.counts["followed"]:  # a takeover: what the last leader counted, by maximum
            self.peer.merge_credit()  # (at start, the learner merged before its intake counted anything)
        self.peer.start_fetcher()
        self.counts["led"] += 1
        logger.info("leading the learners at v%d (%s)", s.version, why)
        self.peer.beat()

    def follow(self, leader: str, same_team: bool = False, deposed: bool = False) -> None:
        """Help ``leader``; ``same_team``: it took over the team this one was in (so they hold the same state);
        ``deposed``: it took over from this learner, whose versions since are not the team's (the state is taken)."""
        self.peer.stop_fetcher()
        self.lead.follow(leader)
        self.leader, self._failed_calls = leader, 0
        self._synced = self._synced and same_team and not deposed
        self._deposed = deposed
        self.counts["followed"] += 1
        logger.info("helping learner %s, which leads", leader)
        self.peer.beat()

    def help_once(self) -> None:
        """One request to the leader, and what its answer says to do (catch up, take a share, ask elsewhere)."""
        s = self.peer.session
        try:
            answer = self.client.work(self.leader, s.version, s.sha, need_state=not self._synced)
        except ProtocolError as e:  # it answered, but not within the protocol: ask for the whole state again
            self.counts["malformed_answers"] += 1
            self._synced = False
            logger.warning("the leading learner %s sent a malformed answer (%s); asking again", self.leader, e)
            self.peer.stop_event.wait(0.5)
            return
        except Exception as e:  # the network boundary: the leader may be gone
            self._leader_unreachable(e)
            return
        self._failed_calls = 0
        if "members" in answer:
            self.members = list(answer["members"])
        if "refused" in answer:
            raise UserError(f"the leading learner refuses this learner's work: {str(answer['refused'])[:200]}")
        if "leader" in answer:  # it does not lead (any more)
            hint = answer["leader"]
            if isinstance(hint, str) and hint not in (self.leader, self.me):
                self.follow(hint, same_team=True)
            else:
                self._succeed(f"learner {self.leader} stopped leading")
            return
        if "state" in answer:
            self._adopt_state(answer["state"])
        for step in answer.get("steps", []):
            self._apply_step(step)
        if "task" in answer:
            self._do_task(answer["task"])

    def _leader_unreachable(self, error: Exception) -> None:
        """A work request failed: a probe (a short call) tells a leader that is gone (dead, frozen, cut off) from
        one that was slow; gone, or failing twice in a row, the next member leads."""
        self._failed_calls += 1
        logger.warning("the leading learner %s did not answer: %s", self.leader, error)
        self._unreachable.pop(self.leader, None)
        if self._failed_calls < 2 and self._probe(self.leader) is not None:
            self.peer.stop_event.wait(0.5)
            return
        self._succeed(f"learner {self.leader} is unreachable")

    def _succeed(self, why: str) -> None:
        """The leader is gone: the first member alive after it leads (this one, or one it then follows)."""
        gone = self.leader
        for member in [m for m in self.members if m != gone]:
            if member == self.me:
                self.take_lead(why)
                return
            deadline = time.monotonic() + TAKEOVER_WAIT
            while time.monotonic() < deadline and not self.peer.stop_event.is_set():
                self._unreachable.pop(member, None)
                answer, leader, _ = self._who_leads(member, gone)
                if answer is None:
                    break  # gone too: the next one
                if leader is not None:
                    self.follow(leader, same_team=True)
                    return
                self.peer.stop_event.wait(0.5)  # alive, not leading yet: it has not noticed
        self.take_lead(why)

    def _adopt_state(self, state: dict) -> None:
        """Take the leader's whole state (this learner was not in its recent lineage); ``state`` fits the schema
        (:class:`~peer.roles.learner.team.messages.State`). Its used seqs are kept, its bans only reported (module
        docstring of :mod:`peer.roles.learner.team.lead`, Trust)."""
        version = state["version"]
        if version < self.peer.session.version and not self._deposed:  # a newer version here (a checkpoint): it
            self.take_lead(f"v{self.peer.session.version} is newer than the leader's v{version}")  # leads
            return
        try:
            self.peer.adopt(state)  # checks the adapter and the AdamW state before it changes anything
        except (ValueError, KeyError, RuntimeError) as e:  # AdapterError is a ValueError
            self._synced = False
            logger.warning("the leader's state does not fit this learner (%s); asking again", e)
            return
        self._synced, self._deposed = True, False
        self._report_bans(state["intake"]["banned"])
        self.counts["states"] += 1
        logger.info("took the leading learner's state at v%d", version)

    def _report_bans(self, banned: dict[str, str]) -> None:
        """Keep the leader's bans as reports (the most recent MAX_BANNED), not as this learner's own."""
        for owner, why in banned.items():
            self.leader_bans[owner] = why
            self.leader_bans.move_to_end(owner)
        while len(self.leader_bans) > MAX_BANNED:
            self.leader_bans.popitem(last=False)

    def _apply_step(self, step: dict) -> None:
        """Apply the leader's update: its clipped gradient through this learner's (identical) AdamW."""
        s = self.peer.session
        if step["version"] != s.version + 1 or step["parent"] != s.sha:
            logger.warning("step v%d does not follow v%d here: asking the leader again", step["version"], s.version)
            return
        t0 = time.perf_counter()
        try:
            grads = tensors_from_bytes(step["grads"], lora_parameters(s.model))
            record = VersionRecord.from_json(step["record"])
        except ValueError as e:
            self._synced = False  # the next request asks for the whole state instead
            logger.warning("the leader's step v%d is unreadable (%s); asking for its state", step["version"], e)
            return
        apply_gradient(s.model, self.peer.state.optimizer, grads, None)
        blob = adapter_to_bytes(s.model)
        sha = sha256_hex(blob)
        if sha != step["sha"]:  # a different torch build rounds differently: take the leader's adapter as it is
            self.counts["drifted"] += 1
            logger.warning(
                "v%d made here hashes to %s…, the leader's to %s…: taking the leader's",
                step["version"],
                sha[:12],
                step["sha"][:12],
            )
            try:
                blob = s.fetch_adapter(step["sha"], step["size"], [self.leader])
                load_adapter_bytes(s.model, blob, step["sha"])
            except Exception as e:  # the network boundary, or a bad blob: this learner no longer holds the lineage
                self._synced = False
                load_adapter_bytes(s.model, s.blob, s.sha)  # back to the version it held; the state comes next
                logger.warning("could not take the leader's v%d (%s); asking for its state", step["version"], e)
                return
            sha = step["sha"]
        delta = {"used": step["intake"]["used"], "banned": {}}  # the leader's bans are reports here, not this one's
        self.peer.intake.restore(delta)
        self.peer.intake.forget_window(step["version"])  # a helper takes nothing: it forgets as the leader steps
        self._report_bans(step["intake"]["banned"])
        self.counts["steps"] += 1
        line = dict(step["record"], applied_seconds=round(time.perf_counter() - t0, 4))
        self.peer.advance(step["parent"], sha, blob, record, None, delta, ledger_line=line)

    def _do_task(self, task: dict) -> None:
        """Compute the gradient of the leader's share for this learner and send it back."""
        s = self.peer.session
        task_id = task["id"]
        try:
            groups = [Accepted(g["owner"], unpack(GroupRecord, g["group"])) for g in task["groups"]]
        except Exception as e:  # from the leader, but over the wire: refuse it
            logger.warning("an unreadable share from the leader (%s)", e)
            return
        share = self.peer.share(groups)  # the leader's own computation of a share, here
        if share is None:
            params = lora_parameters(s.model)
            share = Share([torch.zeros_like(p) for p in params], 0, {})
        try:
            self.client.result(self.leader, task_id, tensors_to_bytes(share.grads), share.tokens, share.stats)
            self.counts["shares"] += 1
        except Exception as e:  # the leader will compute the share itself
            logger.warning("could not send a share's gradient to the leader: %s", e)

    def check_rivals(self) -> threading.Thread:
        """Another learner leading a lineage of its own (two started at once)? The better one stays leader. The
        DHT reads and probes run on a thread of their own, so the updates never wait on them; what it finds
        (``_rival``: the rival's version and peer id) is followed by the next :meth:`leader_turn`, if it still
        wins then."""
        self._next_rival_check = time.monotonic() + RIVAL_CHECK_EVERY
        mine = {v: sha for v, (sha, _) in self.peer.state.window.items()}
        args = (mine, set(self.lead.helpers()), self.peer.session.version)
        self._looking = threading.Thread(target=self._look_for_rival, args=args, name="rival-check", daemon=True)
        self._looking.start()
        return self._looking

    def _look_for_rival(self, mine: dict[int, str], helpers: set[str], version: int) -> None:
        s = self.peer.session
        from peer.network.heartbeat import live_peers

        try:
            alive = {p.record.peer_id for p in live_peers(s.swarm, "learner")}  # a dead one's announcement lingers
            for _, r in announcements(s.swarm, s.admitted):
                if (
                    r.learner not in alive
                    or r.learner in helpers
                    or r.learner == self.me
                    or mine.get(r.version) == r.sha256
                    or r.version < version - team.KEEP_STEPS
                ):
                    continue
                answer = self._probe(r.learner)
                leads = answer and answer.get("leading") and isinstance(answer.get("version"), int)
                if leads and team.wins((answer["version"], r.learner), (version, self.me)):
                    self._rival = (answer["version"], r.learner)
                    return
        except Exception as e:  # the network boundary: look again at the next check
            logger.warning("could not look for other learners leading a lineage: %s", e)

    def collect(self, tasks: dict, deadline: float) -> dict[int, Share]:
        """The helpers' gradients for ``tasks`` (id -> helper, groups, their tokens as counted here) that arrive
        before ``deadline``, checked; late ones are ignored. A share weighs the tokens counted here, whatever the
        helper claims."""
        params = lora_parameters(self.peer.session.model)
        received: dict[int, Share] = {}
        while len(received) < len(tasks):
            try:
                peer, task_id, grads, claimed, stats = self.lead.results.get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                break
            if task_id not in tasks or tasks[task_id][0] != peer:
                continue  # an answer to a task already done here
            tokens = tasks[task_id][2]
            if claimed != tokens:
                self.counts["tokens_disagreed"] += 1
                logger.warning("learner %s counts %d tokens in its share, this leader %d", peer, claimed, tokens)
            try:
                if tokens and not stats:
                    raise ValueError("a share with signal and no statistics")
                received[task_id] = Share(tensors_from_bytes(grads, params), tokens, stats if tokens else {})
            except ValueError as e:
                logger.warning("learner %s sent an unreadable gradient (%s): computing its share here", peer, e)
        return received

    def check_helper(self, helper: str, part: list[Accepted], share: Share) -> Share | None:
        """Recompute a helper's share here; a gradient that differs means it no longer helps this team."""
        self.counts["helper_checks"] += 1
        mine = self.peer.share(part)
        if _same_gradient(mine, share):
            return mine
        self.counts["helpers_refused"] += 1
        why = "its gradient differs from the one recomputed by the leader"
        logger.warning("refusing learner %s: %s", helper, why)
        self.lead.refuse(helper, why)
        return mine


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive parts whose sizes differ by at most one (the first ones are the larger)."""
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


def _same_gradient(a: Share | None, b: Share) -> bool:
    if a is None:
        return b.tokens == 0
    if a.tokens != b.tokens:
        return False
    scale = max(float(g.abs().max()) for g in a.grads) + 1e-8
    worst = max(float((x - y).abs().max()) for x, y in zip(a.grads, b.grads, strict=True))
    return worst <= GRADIENT_TOLERANCE * scale


__all__ = ["Teamwork"]
