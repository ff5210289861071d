"""A learner's metrics record."""

from __future__ import annotations

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import MAX_BANNED, MAX_HISTORY, MAX_REASONS, MAX_TALLIED
from peer.protocol.records import MetricsRecord, PeerTally
from tests.helpers.strategies.common import (
    OVER,
    Kind,
    bad_counts,
    bad_fractions,
    bad_hex,
    bad_peer_ids,
    bad_string,
    counts,
    distinct_hex,
    distinct_name,
    fingerprints,
    fractions,
    grow,
    negative_floats,
    peer_ids,
    set_at,
    short_names,
    single_field,
    sized,
    timestamps,
)


@st.composite
def metrics(draw) -> MetricsRecord:
    rejected = draw(sized(st.tuples(short_names, counts), MAX_REASONS))
    tallies = draw(sized(st.tuples(fingerprints, counts, counts), MAX_TALLIED))
    return MetricsRecord(
        learner=draw(peer_ids),
        version=draw(counts),
        groups_accepted=draw(counts),
        groups_dropped_stale=draw(counts),
        groups_rejected={distinct_name(name, i): n for i, (name, n) in enumerate(rejected)},
        staleness_mean=draw(timestamps),
        staleness_max=draw(counts),
        reward_mean=draw(fractions),
        exact_match=draw(st.none() | fractions),
        step_seconds=draw(timestamps),
        banned=draw(sized(fingerprints, MAX_BANNED)),
        per_peer={distinct_hex(fp, i): PeerTally(accepted=a, rejected=r) for i, (fp, a, r) in enumerate(tallies)},
        reward_history=draw(sized(fractions, MAX_HISTORY)),
        created=draw(timestamps),
    )


METRICS = Kind(
    name="metrics",
    cls=MetricsRecord,
    valid=metrics(),
    **single_field(keys.METRICS_FIELD),
    out_of_range={
        "learner": set_at(("learner",), bad_peer_ids),
        "a count": lambda d, draw: set_at(
            (draw(st.sampled_from(["version", "groups_accepted", "groups_dropped_stale", "staleness_max"])),),
            lambda _: bad_counts(),
        )(d, draw),
        "too many reasons": grow(("groups_rejected",), MAX_REASONS, lambda _r, i: i),
        "reason name": lambda d, draw: d["groups_rejected"].update({draw(bad_string(64)): 1}) or True,
        "reason count": lambda d, draw: d["groups_rejected"].update(x=draw(bad_counts())) or True,
        "negative staleness mean": set_at(("staleness_mean",), lambda _: negative_floats()),
        "reward mean": set_at(("reward_mean",), lambda _: bad_fractions()),
        "exact match": set_at(("exact_match",), lambda _: bad_fractions()),
        "negative step seconds": set_at(("step_seconds",), lambda _: negative_floats()),
        "too many bans": grow(("banned",), MAX_BANNED, lambda _b, i: f"{i:016x}"),
        "banned fingerprint": lambda d, draw: d["banned"].append(draw(bad_hex("0" * 16))) or True,
        "too many producers": lambda d, draw: (
            d.update(per_peer={f"{i:016x}": {"accepted": 1, "rejected": 0} for i in range(MAX_TALLIED + 1)}) or True
        ),
        "producer fingerprint": lambda d, draw: (
            d["per_peer"].update({draw(bad_hex("0" * 16)): {"accepted": 0, "rejected": 0}}) or True
        ),
        "producer tally": lambda d, draw: (
            d["per_peer"].update({"0" * 16: {"accepted": draw(bad_counts()), "rejected": 0}}) or True
        ),
        "too long history": grow(("reward_history",), MAX_HISTORY, lambda _h, i: 0.5),
        "history reward": lambda d, draw: d["reward_history"].append(draw(bad_fractions())) or True,
        "negative created": set_at(("created",), lambda _: negative_floats()),
    },
    oversize=lambda d, draw: d.update(banned=[f"{i:016x}" for i in range(OVER // 16)]),
)
