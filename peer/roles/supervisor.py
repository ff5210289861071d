"""Running one role's peer from start to close: the same for a rollout peer and a learner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from peer.errors import UserError


class RolePeer(Protocol):
    """What the supervisor needs of a role's peer (:class:`~peer.roles.rollout.peer.RolloutPeer`,
    :class:`~peer.roles.learner.peer.LearnerPeer`)."""

    session: Any  # a peer.run.session.Session once started; its ``revoked`` says why the host refused this peer

    def start(self) -> Any: ...

    def run(self) -> Any: ...

    def request_stop(self) -> None: ...

    def close(self) -> None: ...


def supervise(peer: RolePeer, on_ready: Callable[[RolePeer], None] | None = None):
    """Start ``peer``, run it until it stops, close it whatever happened; ``on_ready(peer)`` runs once it started
    (the CLI installs its signal handlers there). Returns what :meth:`run` returned. A peer whose invite the host
    revoked ends in a :class:`~peer.errors.UserError` saying so: the swarm refuses it from then on."""
    try:
        peer.start()
        if on_ready is not None:
            on_ready(peer)
        result = None if peer.session.revoked else peer.run()
        if peer.session.revoked:
            raise UserError(peer.session.revoked)
        return result
    finally:
        peer.close()


__all__ = ["RolePeer", "supervise"]
