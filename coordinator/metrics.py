"""The swarm's status in Prometheus' text format: the host's ``/metrics`` (:mod:`coordinator.web`).

:class:`StatusCollector` turns one reading of :func:`peer.status.read_status` (and the host's newest exact-match
measurement) into metric families, every sample labelled ``run``; :func:`prometheus` renders them with
prometheus_client. Each peer can serve its own numbers too (``--metrics-port``, :mod:`peer.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from peer.metrics import families
from peer.status import LIVE

MAX_PEER_SERIES = 64  # rollout peers labelled in /metrics and plotted per status point: the busiest


def charted(peers: list[dict]) -> list[dict]:
    """The peers a scrape labels and a status point plots: every coordinator and learner (status lists only admitted
    ones), and the ``MAX_PEER_SERIES`` rollout peers with the most groups per second. Heartbeats are claims anyone
    can make: labelling all of them let ~3,500 fake ones make ~14,000 series a scrape, and 0.5 MiB a status point in
    the host's memory (2.2 GiB after 6 h)."""
    core = [p for p in peers if p["role"] != "rollout"]
    rollout = sorted((p for p in peers if p["role"] == "rollout"), key=lambda p: -(p.get("groups_per_s") or 0.0))
    return core + rollout[:MAX_PEER_SERIES]


# (kind, name, help) under ``hivegrpo_``: the names dashboards of a swarm already use
STATUS_METRICS = (
    ("gauge", "adapter_version", "Newest adapter version the learners announced."),
    ("gauge", "peers", "Live peers by role."),
    ("counter", "groups_accepted_total", "Groups used in an update."),
    ("counter", "groups_rejected_total", "Groups refused by verification."),
    ("counter", "groups_rejected_by_reason_total", "Groups refused, by reason."),
    ("counter", "groups_dropped_stale_total", "Groups too old to use."),
    ("gauge", "banned_peers", "Signers banned by a learner."),
    ("gauge", "staleness_mean", "Mean staleness of the newest update."),
    ("gauge", "reward_mean", "Mean reward of the newest update."),
    ("gauge", "exact_match", "Greedy exact match the host measured."),
    ("gauge", "peer_groups_per_second", "Groups per second from each peer's heartbeat."),
    ("gauge", "peer_adapter_version", "Adapter version each peer holds."),
    ("gauge", "peer_blob_served_bytes", "Bytes each peer's blob server sent to other peers (its heartbeat's count)."),
    ("gauge", "peer_blob_fetched_bytes", "Bytes each peer received from other peers' blob servers (its heartbeat's)."),
)


class StatusCollector(Collector):
    """The families of ``read()`` = (the newest status or None, the newest exact match or None) at each scrape."""

    def __init__(self, read: Callable[[], tuple[dict | None, float | None]]):
        self.read = read

    def collect(self) -> Iterator:
        status, exact_match = self.read()
        if status is None:
            return
        peers, who = charted(status["peers"]), ["peer", "role"]
        live = [p for p in peers if p["state"] in LIVE]
        values = {
            "adapter_version": status["adapter_version"],
            "peers": (["role"], dict(status["roles"])),
            "groups_accepted_total": status["groups_accepted"],
            "groups_rejected_total": status["groups_rejected"],
            "groups_rejected_by_reason_total": (["reason"], dict(status["groups_rejected_by_reason"])),
            "groups_dropped_stale_total": status["groups_dropped_stale"],
            "banned_peers": len(status["banned"]),
            "staleness_mean": status["staleness_mean"],
            "reward_mean": status["reward_mean"],
            "exact_match": exact_match,
            "peer_groups_per_second": (who, {(p["peer_id"], p["role"]): p["groups_per_s"] for p in live}),
            "peer_adapter_version": (who, {(p["peer_id"], p["role"]): p["adapter_version"] for p in peers}),
            # a peer that does not report its blob traffic (None) has no sample, not a 0
            "peer_blob_served_bytes": (who, {(p["peer_id"], p["role"]): p.get("served_bytes") for p in peers}),
            "peer_blob_fetched_bytes": (who, {(p["peer_id"], p["role"]): p.get("fetched_bytes") for p in peers}),
        }
        yield from families("hivegrpo_", STATUS_METRICS, values, const={"run": status["run_id"]})


def prometheus(status: dict, exact_match: float | None = None) -> str:
    """The status in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: (status, exact_match)))
    return generate_latest(registry).decode()


__all__ = ["MAX_PEER_SERIES", "STATUS_METRICS", "StatusCollector", "charted", "prometheus"]
