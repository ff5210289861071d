"""The protocol version and the rule for records of other versions.

Every record a peer publishes carries ``protocol_version``. A peer accepts records of its own version only:
:data:`PROTOCOL_VERSION` is a single integer, the *major* version, bumped whenever a key, a subkey or a record
schema changes in a way an older peer would misread (a new field counts: schemas forbid unknown fields). There is
no negotiation and no best-effort reading of other versions: a record of another version is rejected by every
peer's DHT validator when it is stored, and by :func:`check_protocol_version` when it is read from a blob, with a
message naming both versions and saying which side has to upgrade. A swarm therefore runs one protocol version;
the manifest carries it too, so a peer that joins with another version learns so on its first read.
"""

from __future__ import annotations

from typing import Any

from peer.protocol.errors import ProtocolVersionError

PROTOCOL_VERSION = 7  # 7: a bucket entry's inline groups are a packed GroupBatch (bytes), parsed by learners only
# 6: the holders keys and record (peers that serve an adapter version besides its learners)
# 5: a peer's name in its heartbeat; the credit key and record (credit per contributor)
# 4: the learner's demand in its adapter announcements (rollout peers pace to it)
# 3: the learners key and record (only admitted learners write the lineage)
# 2: the access key and record, per-producer tallies and rewards in metrics, invites in blobs


def check_protocol_version(version: Any, what: str) -> None:
    """Raise :class:`ProtocolVersionError` unless ``version`` is this peer's :data:`PROTOCOL_VERSION`.

    ``what`` names the record (e.g. ``"GroupRecord"``) in the message.
    """
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolVersionError(
            f"the {what} record has no valid protocol_version (got {version!r}); it was not written by a "
            f"hivegrpo peer speaking protocol version {PROTOCOL_VERSION}, so it is ignored."
        )
    if version == PROTOCOL_VERSION:
        return
    if version > PROTOCOL_VERSION:
        advice = "upgrade hivegrpo on this peer (pip install -U hivegrpo) to take part in this run"
    else:
        advice = "the peer that wrote it runs an older hivegrpo and must upgrade (pip install -U hivegrpo)"
    raise ProtocolVersionError(
        f"the {what} record uses protocol version {version} but this peer speaks protocol version "
        f"{PROTOCOL_VERSION}; {advice}."
    )
