"""Holder records (a peer that keeps an adapter version's bytes)."""

from __future__ import annotations

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import HOLDER_RING, MAX_BLOB_BYTES
from peer.protocol.records import HolderRecord
from tests.helpers.strategies.common import (
    OVER,
    Kind,
    bad_counts,
    bad_hex,
    bad_peer_ids,
    counts,
    negative_floats,
    owner_subkey,
    peer_ids,
    set_at,
    sha256s,
    timestamps,
)


@st.composite
def holders(draw) -> HolderRecord:
    return HolderRecord(
        peer_id=draw(peer_ids),
        version=draw(counts),
        sha256=draw(sha256s),
        size=draw(st.integers(1, MAX_BLOB_BYTES)),
        created=draw(timestamps),
    )


HOLDER = Kind(
    name="holder",
    cls=HolderRecord,
    valid=holders(),
    key=lambda run, holder: keys.holders_key(run, holder.version),
    subkey=owner_subkey,
    field=lambda holder: keys.holders_field(holder.version % HOLDER_RING),
    out_of_range={
        "peer id": set_at(("peer_id",), bad_peer_ids),
        "version": set_at(("version",), lambda _: bad_counts()),
        "sha256": set_at(("sha256",), bad_hex),
        "size": set_at(("size",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_BLOB_BYTES + 1, 2**64 - 1)),
        "negative created": set_at(("created",), lambda _: negative_floats()),
    },
    oversize=lambda d, draw: d.update(peer_id="Q" * OVER),
)
