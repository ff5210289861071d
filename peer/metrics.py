"""Prometheus metrics of one peer (``hivegrpo join|learn --metrics-port PORT``).

A peer serves ``http://HOST:PORT/metrics`` from a thread (prometheus_client's server) over a private
:class:`~prometheus_client.CollectorRegistry` holding one collector. The collector reads, at each scrape, what the role
counts anyway — its stats, its intake, its publisher, its heartbeat — so nothing is recorded per event for the sake
of metrics, and a peer nobody scrapes pays nothing. Every number here is this peer's own; the swarm's view is the
host's ``/metrics`` (:mod:`coordinator.metrics`).

The roles' state is written by their own threads while a scrape reads it: the collectors only take lengths, plain
attributes and C-level copies (``dict(counter)``, ``list(d.values())``), which never see a dict changing size.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from peer.errors import UserError
from peer.log import get_logger
from peer.protocol import key_fingerprint

logger = get_logger(__name__)


# (kind, name, help) of every metric a role serves, under ``hivegrpo_rollout_`` / ``hivegrpo_learner_``; a collector
# gives each a value, or (label names, {label values: value}), or None while it is not known (left out)
ROLLOUT_METRICS = (
    ("gauge", "adapter_version", "Adapter version sampled with now."),
    ("gauge", "batch_size", "Prompts per batch."),
    ("gauge", "groups_per_second", "Groups per second over the recent batches (as in the heartbeat), waits included."),
    ("counter", "groups_sampled_total", "Groups sampled."),
    ("counter", "groups_published_total", "Groups stored in the buckets."),
    ("counter", "groups_publish_failed_total", "Groups whose store failed."),
    ("counter", "completions_total", "Completions sampled."),
    ("counter", "tokens_total", "Completion tokens sampled."),
    ("counter", "batches_total", "Batches sampled."),
    ("counter", "adapter_swaps_total", "Adapter versions swapped in."),
    ("counter", "adapter_fetches_total", "Adapter versions fetched over the network."),
    ("counter", "adapter_fetched_bytes_total", "Adapter bytes received (refused and cut transfers included)."),
    ("gauge", "adapters_refused", "Adapter versions refused (blob would not load or check); the newest 256 kept."),
    ("counter", "waited_seconds_total", "Seconds spent waiting for the learners (pacing, backpressure)."),
    ("counter", "sample_seconds_total", "Seconds spent sampling batches."),
    ("counter", "score_seconds_total", "Seconds the publisher's process spent scoring and building records."),
    ("gauge", "paced", "1 while pacing to a learner's announced demand, 0 under backpressure (the bucket's fill)."),
    ("gauge", "pace_groups_per_second", "Groups per second pacing aims at (this peer's share of the demand)."),
)

LEARNER_METRICS = (
    ("gauge", "adapter_version", "Adapter version held."),
    ("counter", "versions_made_total", "Versions made (or, helping, applied)."),
    ("counter", "groups_used_total", "Groups in the updates (as the ledger lists them)."),
    ("counter", "groups_no_signal_total", "Verified groups whose rewards were all equal (counted, not kept)."),
    ("counter", "groups_dropped_stale_total", "Groups too old to use."),
    ("counter", "groups_refused_total", "Groups refused, by reason."),
    ("counter", "groups_ignored_banned_total", "Groups of banned signers, ignored."),
    ("counter", "logprob_checks_total", "Groups whose behaviour log-probs were recomputed."),
    ("counter", "takes_short_total", "Takes that found too few groups for an update, by cause."),
    ("gauge", "banned_peers", "Signers banned for this run."),
    ("gauge", "pool_groups", "Verified groups waiting for an update."),
    ("gauge", "checks_waiting", "Groups waiting for a log-prob check."),
    ("gauge", "busy_fraction", "Training CPU seconds per wall second over the recent versions (as status shows)."),
    ("counter", "phase_seconds_total", "Wall seconds of the leading loop by phase."),
    ("counter", "train_cpu_seconds_total", "CPU seconds spent computing updates."),
    ("gauge", "groups_per_second", "Groups used per second over the recent versions (as in the heartbeat)."),
    ("gauge", "staleness_mean", "Mean staleness of the newest update."),
    ("gauge", "reward_mean", "Mean reward of the newest update."),
    ("counter", "announce_failures_total", "Announcements that could not be stored."),
    ("gauge", "leading", "1 while this learner leads its team."),
    ("gauge", "helpers", "Learners computing shares of this one's updates."),
)

# under ``hivegrpo_`` whatever the role: the peer's blob server and fetches, read from its heartbeat's stats (a peer
# whose heartbeat does not count them yet serves neither)
BLOB_METRICS = (
    ("counter", "blob_served_bytes_total", "Bytes this peer's blob server sent to other peers."),
    ("counter", "blob_fetched_bytes_total", "Bytes this peer received from other peers' blob servers."),
)


def families(prefix: str, table: tuple, values: dict, const: dict[str, str] | None = None) -> Iterator[Metric]:
    """The metric families of ``table`` (see :data:`ROLLOUT_METRICS`) with ``values`` by name, each sample labelled
    ``const`` too. A value is a number, ``(label names, {label value or tuple of them: number})``, or None; a family
    with no number (not known yet, nothing counted by label) is left out, as is a labelled None."""
    const = const or {}
    for kind, name, doc in table:
        value = values.get(name)
        labels, by = value if isinstance(value, tuple) else ((), {(): value})
        by = {key if isinstance(key, tuple) else (key,): v for key, v in by.items() if v is not None}
        if not by:
            continue
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        metric = cls(prefix + name, doc, labels=[*const, *labels])
        for key, v in sorted(by.items()):
            metric.add_metric([*const.values(), *map(str, key)], float(v))
        yield metric


def _heartbeat(session) -> dict:
    beat = getattr(session, "heartbeat", None)
    return beat.fields() if beat is not None else {}


def _blobs(session) -> Iterator[Metric]:
    """The blob traffic counters of the heartbeat's stats (``served_bytes``, ``fetched_bytes``), when it has them."""
    stats = _heartbeat(session).get("stats") or {}
    values = {
        "blob_served_bytes_total": stats.get("served_bytes"),
        "blob_fetched_bytes_total": stats.get("fetched_bytes"),
    }
    yield from families("hivegrpo_", BLOB_METRICS, values)


def _info(role: str, peer) -> Metric:
    session = peer.session
    labels = {"run": peer.config.run_id}
    if session is not None:
        labels["peer_id"] = str(session.swarm.peer_id)
        labels["signer"] = key_fingerprint(session.swarm.public_key)
    return InfoMetricFamily(f"hivegrpo_{role}", f"This {role} peer (its signer once it has joined).", value=labels)


class RolloutCollector(Collector):
    """What a :class:`~peer.roles.rollout.peer.RolloutPeer` has done, read from its stats, publisher and follower."""

    def __init__(self, peer):
        self.peer = peer

    def collect(self) -> Iterator[Metric]:
        p = self.peer
        stats = dict(p.stats)
        session, publisher, follower = p.session, p.publisher, p.follower
        group_size = p.spec.sampling.group_size if p.spec is not None else None
        throughput = _heartbeat(session).get("throughput")  # completions/s over the recent batches, waits included
        backlog, pacer = getattr(p, "backlog", None), getattr(p, "pacer", None)
        paced = None if backlog is None else not backlog.active  # the loop sets it each time it decides to wait
        values = {
            "adapter_version": p.version if session is not None else None,
            "batch_size": getattr(p, "batch_size", None),
            "groups_per_second": throughput / group_size if throughput is not None and group_size else None,
            "groups_sampled_total": stats["groups"],
            "completions_total": stats["completions"],
            "tokens_total": stats["tokens"],
            "batches_total": stats["batches"],
            "adapter_swaps_total": stats["swaps"],
            "waited_seconds_total": stats["waited_s"],
            "sample_seconds_total": stats["sample_s"],
            "paced": paced,
            "pace_groups_per_second": pacer.rate(getattr(follower, "demand", None)) if paced and pacer else None,
        }
        if publisher is not None:
            values |= {
                "groups_published_total": publisher.published,
                "groups_publish_failed_total": publisher.failed,
                "score_seconds_total": publisher.prepare_seconds,
            }
        if follower is not None:
            values |= {
                "adapter_fetches_total": follower.fetches,
                "adapter_fetched_bytes_total": follower.received.bytes,
                "adapters_refused": len(follower.refused),
            }
        yield _info("rollout", p)
        yield from families("hivegrpo_rollout_", ROLLOUT_METRICS, values)
        yield from _blobs(session)


class LearnerCollector(Collector):
    """What a :class:`~peer.roles.learner.peer.LearnerPeer` has done, read from its counters, intake and heartbeat."""

    def __init__(self, peer):
        self.peer = peer

    def collect(self) -> Iterator[Metric]:
        p = self.peer
        session, intake, announcer = p.session, p.intake, getattr(p, "announcer", None)
        history = list(p.history)
        newest = history[-1] if history else None
        values = {
            "adapter_version": session.version if session is not None else None,
            "versions_made_total": p.made,
            "groups_used_total": sum(h.groups for h in history),
            "busy_fraction": p.busy,
            "phase_seconds_total": (["phase"], dict(p.phases)),
            "train_cpu_seconds_total": p.train_cpu,
            "groups_per_second": _heartbeat(session).get("throughput"),
            "staleness_mean": newest.staleness_mean if newest is not None else None,
            "reward_mean": newest.reward_mean if newest is not None else None,
            "announce_failures_total": announcer.failures if announcer is not None else None,
        }
        if intake is not None:
            counts = dict(intake.counts)
            values |= {
                "groups_no_signal_total": counts.get("no_signal", 0),
                "groups_dropped_stale_total": counts.get("dropped_stale", 0),
                "groups_refused_total": (["reason"], dict(intake.rejected)),
                "groups_ignored_banned_total": counts.get("ignored_banned", 0),
                "logprob_checks_total": counts.get("checked", 0),
                "takes_short_total": (
                    ["cause"],
                    {"groups": counts.get("short", 0), "per_signer_cap": counts.get("short_capped", 0)},
                ),
                "banned_peers": len(intake.banned),
                "pool_groups": sum(map(len, list(intake.pool.values()))),
                "checks_waiting": intake.checks_waiting(),
            }
        if p.team.lead is not None:  # its team is started
            values |= p.team.heartbeat_stats()  # leading, helpers
        yield _info("learner", p)
        yield from families("hivegrpo_learner_", LEARNER_METRICS, values)
        yield from _blobs(session)


class MetricsServer:
    """``/metrics`` of one collector on ``(host, port)``, served from a thread until :meth:`close`."""

    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 0):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise UserError(
                f"cannot serve metrics on {host}:{port} ({e.strerror or e}); pass another --metrics-port, or 0 for "
                "any free one"
            ) from None
        self.host, self.port = host, self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def serve_metrics(collector: Collector, host: str, port: int) -> MetricsServer:
    """Serve ``collector`` at ``http://host:port/metrics`` (port 0: any free one); logs the URL."""
    server = MetricsServer(collector, host, port)
    logger.info("metrics at %s", server.url)
    return server


__all__ = [
    "BLOB_METRICS",
    "LEARNER_METRICS",
    "ROLLOUT_METRICS",
    "LearnerCollector",
    "MetricsServer",
    "RolloutCollector",
    "families",
    "serve_metrics",
]
