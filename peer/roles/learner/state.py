"""A learner's lineage state, and the only ways it changes.

:class:`LearnerState` holds what makes a learner's position in the run's lineage: the model at the version the
session holds (``version``, ``sha``, the adapter ``blob``), the AdamW state, the parent of that version, a window of
recent versions' LoRA tensors (spot checks visit old versions) and the intake's memory of the seqs updates used.
The learner's loop, its resume and its teamwork change it through four verbs only:

* :meth:`advance`: the model now holds the next version (made here, or a leader's step applied here);
* :meth:`adopt`: a leader's whole state replaces this learner's (a helper outside the leader's recent lineage);
* :meth:`snapshot`: the whole state as the team protocol sends it to such a helper;
* :meth:`remember`: keep the held version's tensors in the window, and let versions older than the window go.

What a version *means* beyond the state (the journal line, the announcement, the ledger, the heartbeat) is the
learner's (:meth:`peer.roles.learner.peer.LearnerPeer.advance`).
"""

from __future__ import annotations

import torch

from peer.model.adapter import lora_parameters
from peer.roles.learner.intake import Intake
from peer.roles.learner.update import optimizer_state_from_wire, optimizer_state_to_wire

KEEP_ADAPTERS = 2  # versions beyond the staleness window whose blobs stay in the cache (for slow followers)


class LearnerState:
    def __init__(self, session, optimizer: torch.optim.Optimizer, intake: Intake):
        self.session = session  # holds the model, and its version, sha256 and adapter blob (Session.swap)
        self.optimizer = optimizer
        self.intake = intake
        self.parent = session.parent  # the sha256 of the held version's parent ("" at v0)
        # per version of the window: its sha256 and a copy of its LoRA tensors (spot checks visit old versions)
        self.window: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self.checkpointed: frozenset = frozenset()  # the sha256 of the adapter in the checkpoint (kept cached)
        self.bans_recorded = 0  # intake.bans_made already in the journal and told to helpers (banned keeps the order)

    def remember(self) -> None:
        """Keep the held version's tensors in the window; drop versions older than the window, and their blobs."""
        s = self.session
        self.window[s.version] = (s.sha, [p.detach().clone() for p in lora_parameters(s.model)])
        self.intake.known[s.version] = s.sha
        oldest = s.version - s.spec.staleness.tau_max - KEEP_ADAPTERS
        for v in [v for v in self.window if v < oldest]:
            old_sha, _ = self.window.pop(v)
            if v > 0 and old_sha not in self.checkpointed:
                s.blobs.cache.remove(old_sha)

    def advance(self, parent: str, sha: str, blob: bytes) -> None:
        """The model holds version ``version + 1`` now (``sha``, ``blob``), the child of ``parent``."""
        s = self.session
        s.version, s.sha, s.blob = s.version + 1, sha, blob
        self.parent = parent
        self.remember()

    def intake_delta(self, chosen) -> dict:
        """What an update over ``chosen`` changed in the intake's lasting state (:meth:`Intake.restore` takes it):
        the seqs it used, and the bans since the previous update."""
        used: dict[str, list[list[int]]] = {}
        for a in chosen:
            used.setdefault(a.owner.hex(), []).append([a.group.seq, a.group.version])
        new = min(self.intake.bans_made - self.bans_recorded, len(self.intake.banned))
        banned = list(self.intake.banned.items())[len(self.intake.banned) - new :] if new > 0 else []
        self.bans_recorded = self.intake.bans_made
        return {"used": used, "banned": {owner.hex(): why for owner, why in banned}}

    def snapshot(self) -> dict:
        """The whole state, as the team protocol's ``state`` answer carries it (:class:`~peer.roles.learner.team.
        messages.State`)."""
        s = self.session
        return {
            "version": s.version,
            "sha": s.sha,
            "parent": self.parent or "",
            "adapter": s.blob,
            "optimizer": optimizer_state_to_wire(self.optimizer),
            "intake": self.intake.state(),
        }

    def adopt(self, state: dict) -> None:
        """Take a leader's whole state (``state`` fits :class:`~peer.roles.learner.team.messages.State`): its
        adapter (checked before anything changes), its AdamW moments under this learner's own hyper-parameters, its
        used seqs. Its bans are not this learner's (the caller reports them). Raises ``ValueError`` (also for an
        adapter that fails its check), ``KeyError`` or ``RuntimeError`` when the state does not fit: the AdamW state
        and the adapter are both checked before either is loaded."""
        optimizer_state = optimizer_state_from_wire(self.optimizer, state["optimizer"])
        self.session.swap(state["version"], state["sha"], state["adapter"])  # checks the blob before it changes
        self.optimizer.load_state_dict(optimizer_state)
        intake = self.intake
        intake.pool.clear()
        intake.pending_checks()
        intake.known.clear()
        intake.restore({"used": state["intake"]["used"]})
        self.window.clear()
        self.parent = state["parent"]
        self.remember()
        self.bans_recorded = intake.bans_made


__all__ = ["KEEP_ADAPTERS", "LearnerState"]
