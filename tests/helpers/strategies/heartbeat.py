"""Heartbeats (a peer's record under the peers key; a learner's and the coordinator's under core_peers too)."""

from __future__ import annotations

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import MAX_INT, MAX_MADDR_CHARS, MAX_MADDRS, MAX_NAME_CHARS, MAX_STATS
from peer.protocol.records import PeerRecord
from tests.helpers.strategies.common import (
    OVER,
    Kind,
    bad_peer_ids,
    bad_peer_names,
    bad_string,
    distinct_name,
    finite_floats,
    grow,
    negative_floats,
    peer_ids,
    peer_names,
    set_at,
    short_names,
    single_field,
    sized,
    timestamps,
)


@st.composite
def heartbeats(draw) -> PeerRecord:
    started, last_seen = sorted(draw(st.lists(timestamps, min_size=2, max_size=2)))
    stats = draw(sized(st.tuples(short_names, finite_floats), MAX_STATS))
    return PeerRecord(
        peer_id=draw(peer_ids),
        role=draw(st.sampled_from(["coordinator", "rollout", "learner", "observer"])),
        adapter_version=draw(st.integers(-1, MAX_INT)),
        throughput=draw(timestamps),
        hardware=draw(st.text(max_size=MAX_NAME_CHARS)),
        reachable=draw(st.booleans()),
        maddrs=draw(sized(st.text(min_size=1, max_size=MAX_MADDR_CHARS), MAX_MADDRS)),
        started=started,
        last_seen=last_seen,
        state=draw(st.sampled_from(["starting", "running", "leaving"])),
        stats={distinct_name(name, i): value for i, (name, value) in enumerate(stats)},
        name=draw(st.none() | peer_names),
    )


def _seen_before_start(d, draw):
    if d["started"] == 0.0:
        return False
    d["last_seen"] = draw(st.floats(0.0, d["started"], exclude_max=True))
    return True


HEARTBEAT = Kind(
    name="heartbeat",
    cls=PeerRecord,
    valid=heartbeats(),
    **single_field(keys.PEERS_FIELD),
    also=(keys.CORE_PEERS_FIELD,),
    out_of_range={
        "peer id": set_at(("peer_id",), bad_peer_ids),
        "role": set_at(("role",), lambda _: st.sampled_from(["admin", "Learner", ""])),
        "adapter version": set_at(
            ("adapter_version",), lambda _: st.integers(-(2**63), -2) | st.integers(MAX_INT + 1, 2**64 - 1)
        ),
        "negative throughput": set_at(("throughput",), lambda _: negative_floats()),
        "hardware": set_at(("hardware",), lambda _: bad_string(MAX_NAME_CHARS, empty_ok=True)),
        "too many maddrs": grow(("maddrs",), MAX_MADDRS, lambda _m, i: f"/ip4/10.0.0.{i % 256}/tcp/{i}"),
        "maddr": set_at(("maddrs", "*"), lambda _: bad_string(MAX_MADDR_CHARS)),
        "negative started": lambda d, draw: d.update(started=draw(negative_floats())) or True,
        "seen before start": _seen_before_start,
        "state": set_at(("state",), lambda _: st.sampled_from(["dead", "Running", ""])),
        "too many stats": grow(("stats",), MAX_STATS, lambda _s, i: float(i)),
        "stat name": lambda d, draw: d["stats"].update({draw(bad_string(64)): 1.0}) or True,
        "name": set_at(("name",), lambda _: bad_peer_names()),
    },
    oversize=lambda d, draw: d.update(hardware="x" * OVER),
)
