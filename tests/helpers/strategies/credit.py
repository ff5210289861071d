"""A learner's credit record (what each contributor's groups became)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import MAX_CREDIT, MAX_CREDIT_REASONS, MAX_CREDITED, MAX_INT
from peer.protocol.records import Credit, CreditRecord
from tests.helpers.strategies.common import (
    OVER,
    Kind,
    bad_counts,
    bad_hex,
    bad_peer_ids,
    bad_peer_names,
    counts,
    credit_counts,
    distinct_hex,
    fingerprints,
    negative_floats,
    peer_ids,
    peer_names,
    reasons,
    set_at,
    single_field,
    sized,
    timestamps,
)


@st.composite
def credit_entries(draw) -> Credit:
    listed = draw(
        st.dictionaries(reasons, st.integers(0, MAX_CREDIT // MAX_CREDIT_REASONS), max_size=MAX_CREDIT_REASONS)
    )
    refused = draw(st.integers(sum(listed.values()), MAX_CREDIT))
    return Credit(
        name=draw(st.none() | peer_names),
        used=draw(credit_counts),
        refused=refused,
        reasons=listed,
        stale=draw(credit_counts),
        no_signal=draw(credit_counts),
        since=draw(timestamps),
    )


@st.composite
def credits(draw) -> CreditRecord:
    entries = draw(sized(st.tuples(fingerprints, credit_entries()), MAX_CREDITED))
    contributors = {distinct_hex(fp, i): credit for i, (fp, credit) in enumerate(entries)}
    used = sum(c.used for c in contributors.values())
    return CreditRecord(
        learner=draw(peer_ids),
        version=draw(counts),
        groups_used=draw(st.integers(used, MAX_INT)),
        contributors_known=draw(st.integers(len(contributors), MAX_INT)),
        contributors=contributors,
        created=draw(timestamps),
    )


def _credit_entry(i: int) -> dict:
    return {"name": None, "used": 1, "refused": 0, "reasons": {}, "stale": 0, "no_signal": 0, "since": 1.0}


def _a_contributor(d, draw) -> dict | None:
    return d["contributors"][draw(st.sampled_from(sorted(d["contributors"])))] if d["contributors"] else None


def _contributor_field(field: str, strategy_of: Callable[[Any], st.SearchStrategy]) -> Callable:
    def mutate(d, draw):
        entry = _a_contributor(d, draw)
        if entry is None:
            return False
        entry[field] = draw(strategy_of(entry[field]))
        return True

    return mutate


def _more_contributors(d, draw):
    n = MAX_CREDITED + draw(st.integers(1, 3))
    d["contributors"] = {f"{i:016x}": _credit_entry(i) for i in range(n)}
    d.update(groups_used=n, contributors_known=n)
    return True


def _more_reasons(d, draw):
    entry = _a_contributor(d, draw)
    if entry is None:
        return False
    n = MAX_CREDIT_REASONS + draw(st.integers(1, 3))
    entry.update(reasons={f"r{chr(97 + i)}": 1 for i in range(n)}, refused=n)
    return True


def _reasons_over_refused(d, draw):
    entry = _a_contributor(d, draw)
    if entry is None or entry["refused"] >= MAX_CREDIT:
        return False
    entry["reasons"] = {"reward": entry["refused"] + 1}
    return True


def _used_over_total(d, draw):
    used = sum(c["used"] for c in d["contributors"].values())
    if used == 0:
        return False
    d["groups_used"] = draw(st.integers(0, used - 1))
    return True


def _known_below_listed(d, draw):
    if not d["contributors"]:
        return False
    d["contributors_known"] = draw(st.integers(0, len(d["contributors"]) - 1))
    return True


def _bad_credit_count(_old) -> st.SearchStrategy[int]:
    return st.integers(-(2**63), -1) | st.integers(MAX_CREDIT + 1, 2**64 - 1)


CREDIT = Kind(
    name="credit",
    cls=CreditRecord,
    valid=credits(),
    **single_field(keys.CREDIT_FIELD),
    out_of_range={
        "learner": set_at(("learner",), bad_peer_ids),
        "a count": lambda d, draw: set_at(
            (draw(st.sampled_from(["version", "groups_used", "contributors_known"])),), lambda _: bad_counts()
        )(d, draw),
        "too many contributors": _more_contributors,
        "contributor fingerprint": lambda d, draw: (
            d["contributors"].update({draw(bad_hex("0" * 16)): _credit_entry(0)}) or True
        ),
        "contributor count": lambda d, draw: _contributor_field(
            draw(st.sampled_from(["used", "refused", "stale", "no_signal"])), _bad_credit_count
        )(d, draw),
        "contributor name": _contributor_field("name", lambda _: bad_peer_names()),
        "negative since": _contributor_field("since", lambda _: negative_floats()),
        "too many reasons": _more_reasons,
        "reason name": lambda d, draw: _contributor_field(
            "reasons", lambda _: st.sampled_from(["", "Reward", "1x", "_x", "a" * 17, "re ward"]).map(lambda r: {r: 0})
        )(d, draw),
        "reasons over refused": _reasons_over_refused,
        "used over groups_used": _used_over_total,
        "known below listed": _known_below_listed,
        "negative created": set_at(("created",), lambda _: negative_floats()),
    },
    oversize=lambda d, draw: d.update(
        contributors={f"{i:016x}": _credit_entry(i) for i in range(OVER // 70)},
        groups_used=OVER,
        contributors_known=OVER,
    ),
)
