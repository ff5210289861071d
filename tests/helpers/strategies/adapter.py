"""Adapter announcements (a learner's newest version and its lineage)."""

from __future__ import annotations

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import MAX_ANCESTORS, MAX_BLOB_BYTES, MAX_INT, MAX_PROVIDERS
from peer.protocol.records import AdapterRecord
from tests.helpers.strategies.common import (
    OVER,
    Kind,
    bad_counts,
    bad_hex,
    bad_peer_ids,
    base58,
    counts,
    distinct_peer_id,
    negative_floats,
    peer_ids,
    provider_rules,
    set_at,
    sha256s,
    single_field,
    sized,
    timestamps,
)


@st.composite
def adapters(draw) -> AdapterRecord:
    version = draw(counts)
    sha = draw(sha256s)
    parent = "" if version == 0 else draw(sha256s.filter(lambda other: other != sha))
    older = draw(st.lists(sha256s, max_size=min(MAX_ANCESTORS, version) - 1)) if version else []
    return AdapterRecord(
        version=version,
        sha256=sha,
        parent_sha256=parent,
        ancestors=[parent, *older] if version else [],
        size=draw(st.integers(1, MAX_BLOB_BYTES)),
        providers=draw(sized(peer_ids, MAX_PROVIDERS, min_size=1, distinct=distinct_peer_id)),
        created=draw(timestamps),
        learner=draw(peer_ids),
    )


def _lineage(d, draw):
    how = draw(st.sampled_from(["v0 with parent", "later without parent", "own parent"]))
    if how == "v0 with parent":
        d.update(version=0, parent_sha256=draw(sha256s.filter(lambda s: s != d["sha256"])))
    elif how == "later without parent":
        d.update(version=draw(st.integers(1, MAX_INT)), parent_sha256="")
    else:
        d.update(version=draw(st.integers(1, MAX_INT)), parent_sha256=d["sha256"])
    return True


ADAPTER = Kind(
    name="adapter",
    cls=AdapterRecord,
    valid=adapters(),
    **single_field(keys.ADAPTER_FIELD),
    out_of_range={
        "version": set_at(("version",), lambda _: bad_counts()),
        "sha256": set_at(("sha256",), bad_hex),
        "parent sha256": lambda d, draw: d["version"] > 0 and set_at(("parent_sha256",), bad_hex)(d, draw),
        "lineage": _lineage,
        "ancestors not from the parent": lambda d, draw: (
            d["version"] > 0 and d.update(ancestors=[draw(sha256s.filter(lambda s: s != d["parent_sha256"]))]) is None
        ),
        "more ancestors than versions": lambda d, draw: (
            d.update(
                version=1,
                ancestors=[d["parent_sha256"] or "a" * 64, "b" * 64],
                parent_sha256=d["parent_sha256"] or "a" * 64,
            )
            is None
        ),
        "too many ancestors": lambda d, draw: (
            d.update(version=MAX_INT, parent_sha256="a" * 64, ancestors=["a" * 64] * (MAX_ANCESTORS + 1)) is None
        ),
        "size": set_at(("size",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_BLOB_BYTES + 1, 2**64 - 1)),
        **provider_rules(("providers",)),
        "negative created": set_at(("created",), lambda _: negative_floats()),
        "learner": set_at(("learner",), bad_peer_ids),
    },
    oversize=lambda d, draw: d.update(providers=["Qm" + base58(i, 4) for i in range(OVER // 4)]),
)
