"""hypothesis strategies for the protocol's records: valid ones within every documented bound, ways to break them,
and junk. One module per record kind, each with its :class:`~tests.helpers.strategies.common.Kind`; the building
blocks they share are in :mod:`~tests.helpers.strategies.common`.

* ``KINDS``: every record stored in the DHT (manifest, heartbeat, adapter announcement, bucket entry inline and
  pointer, metrics, access list, credit, holder), each with a strategy of valid records, the key and subkey it
  lives under, and the ways to put one of its values out of range.
* ``VALUE_MUTATIONS``: edits of a record's value (the dict ``to_dht_value`` makes), each one known to make it
  invalid: a missing or extra field, a wrong type, a non-finite number, another protocol version;
  :func:`mutated_value` adds a value over the DHT size limit, :func:`out_of_range` each of a kind's range rules.
* ``BATCH_BREAKS``: edits of a packed batch of groups (an inline entry's bytes) that only its reader refuses.
* ``junk``: arbitrary msgpack-able values, as hivemind's serializer carries them (tuples included).

Lists are drawn with :func:`~tests.helpers.strategies.common.sized`: any length in their range, bounds included,
elements cycled from a few drawn ones, so a list at its bound (1024 revoked invites, 64 completions) costs no more
to generate than a short one.
"""

from tests.helpers.strategies.access import ACCESS
from tests.helpers.strategies.adapter import ADAPTER
from tests.helpers.strategies.common import (
    Kind,
    at,
    counts,
    fractions,
    nodes,
    put,
    run_ids,
    sha256s,
    timestamps,
    token_ids,
)
from tests.helpers.strategies.credit import CREDIT
from tests.helpers.strategies.edits import VALUE_MUTATIONS, mutated_value, out_of_range
from tests.helpers.strategies.entry import BATCH_BREAKS, INLINE, POINTER
from tests.helpers.strategies.heartbeat import HEARTBEAT
from tests.helpers.strategies.holder import HOLDER
from tests.helpers.strategies.junk import junk, near_records
from tests.helpers.strategies.manifest import MANIFEST
from tests.helpers.strategies.metrics import METRICS

KINDS = {kind.name: kind for kind in (MANIFEST, HEARTBEAT, ADAPTER, INLINE, POINTER, METRICS, ACCESS, CREDIT, HOLDER)}

__all__ = [
    "BATCH_BREAKS",
    "INLINE",
    "KINDS",
    "VALUE_MUTATIONS",
    "Kind",
    "at",
    "counts",
    "fractions",
    "junk",
    "mutated_value",
    "near_records",
    "nodes",
    "out_of_range",
    "put",
    "run_ids",
    "sha256s",
    "timestamps",
    "token_ids",
]
