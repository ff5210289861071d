"""Anything a peer can be sent that is not a record."""

from __future__ import annotations

from hypothesis import strategies as st

from peer.protocol.version import PROTOCOL_VERSION

junk_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=24)
    | st.binary(max_size=32)
)
junk = st.recursive(
    junk_scalars,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=12) | st.binary(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
"""Anything hivemind's MSGPackSerializer carries: tuples too (its ext type 0x40), dict keys str or bytes."""


def near_records(cls: type) -> st.SearchStrategy[dict]:
    """Maps that look like a ``cls`` record: this protocol version and some of its field names, junk values."""
    fields = {name: junk for name in cls.__fields__ if name != "protocol_version"}
    return st.fixed_dictionaries({"protocol_version": st.just(PROTOCOL_VERSION)}, optional=fields)
