"""A private run's access list (revoked invites, signed by the host)."""

from __future__ import annotations

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import MAX_REVOKED
from peer.protocol.records import AccessRecord
from tests.helpers.strategies.common import (
    HEX,
    OVER,
    Kind,
    bad_hex,
    fingerprints,
    grow,
    negative_floats,
    set_at,
    sha256s,
    single_field,
    sized,
    timestamps,
)


@st.composite
def access_lists(draw) -> AccessRecord:
    return AccessRecord(
        issuer=draw(sha256s),
        revoked=draw(sized(fingerprints, MAX_REVOKED)),
        created=draw(timestamps),
        signature=draw(st.text(HEX, min_size=128, max_size=128)),
    )


ACCESS = Kind(
    name="access",
    cls=AccessRecord,
    valid=access_lists(),
    **single_field(keys.ACCESS_FIELD),
    out_of_range={
        "issuer": set_at(("issuer",), bad_hex),
        "too many revoked": grow(("revoked",), MAX_REVOKED, lambda _r, i: f"{i:016x}"),
        "revoked id": lambda d, draw: d["revoked"].append(draw(bad_hex("0" * 16))) or True,
        "negative created": set_at(("created",), lambda _: negative_floats()),
        "signature": set_at(("signature",), bad_hex),
    },
    oversize=lambda d, draw: d.update(revoked=[f"{i:016x}" for i in range(OVER // 16)]),
)
