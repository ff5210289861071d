"""Bucket entries: groups inline (a packed GroupBatch), or a pointer to a blob of them; and the ways a batch of groups
can be broken, which only its reader (``groups_of``) can tell, as the DHT stores a batch as bytes."""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import (
    MAX_BLOB_BYTES,
    MAX_COMPLETION_TOKENS,
    MAX_DHT_VALUE_BYTES,
    MAX_GROUP_BATCH_BYTES,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_ENTRY,
    MAX_INLINE_BATCH_BYTES,
    MAX_INT,
    MAX_PROMPT_TOKENS,
    MAX_PROVIDERS,
)
from peer.protocol.records import (
    BlobPointer,
    BucketEntry,
    Completion,
    GroupRecord,
    encode_floats,
    encode_tokens,
    fits_inline,
)
from tests.helpers.records import make_group
from tests.helpers.strategies.common import (
    FLOAT32_TINY,
    OVER,
    Kind,
    at,
    bad_counts,
    bad_fractions,
    bad_hex,
    bad_peer_ids,
    base58,
    counts,
    distinct_peer_id,
    fixed,
    fractions,
    logprobs,
    negative_floats,
    peer_ids,
    provider_rules,
    set_at,
    sha256s,
    sized,
    timestamps,
    token_ids,
)


@st.composite
def completions(draw, max_tokens: int) -> Completion:
    n = draw(st.integers(1, max_tokens))
    tokens = draw(sized(token_ids, n, min_size=n))
    return Completion(token_ids=encode_tokens(tokens), logprobs=encode_floats(draw(sized(logprobs, n, min_size=n))))


GROUP_FRAMING = 450  # bytes of a packed group besides its tokens and completions (names, hashes, numbers)
COMPLETION_FRAMING = 36  # bytes per completion besides its tokens (two names, two headers, a reward)


@st.composite
def groups(draw, version: int, seq: int, budget: int) -> GroupRecord:
    """A valid group that packs to at most ``budget`` bytes."""
    size = draw(st.integers(2, max(2, min(MAX_GROUP_SIZE, (budget - GROUP_FRAMING) // (COMPLETION_FRAMING + 8)))))
    room = budget - GROUP_FRAMING - size * COMPLETION_FRAMING
    prompt = draw(sized(token_ids, max(1, min(MAX_PROMPT_TOKENS, room // 8)), min_size=1))
    per_completion = max(1, min(MAX_COMPLETION_TOKENS, (room - 4 * len(prompt)) // (8 * size)))
    made = draw(sized(completions(per_completion), size, min_size=size))
    return make_group(
        version=version,
        adapter_sha256=draw(sha256s),
        producer=draw(peer_ids),
        seq=seq,
        task_seed=draw(counts),
        task_index=draw(counts),
        prompt=prompt,
        completions=made,
        rewards=draw(sized(fractions, size, min_size=size)),
        created=draw(timestamps),
    )


@st.composite
def inline_entries(draw) -> BucketEntry:
    # mostly a few groups, sometimes up to the most an entry holds (each takes a share of the same byte budget)
    n = draw(st.integers(1, MAX_GROUPS_PER_ENTRY) if draw(st.integers(0, 3)) == 0 else st.integers(1, 3))
    version = draw(counts)
    seq = draw(st.integers(0, MAX_INT - n + 1))
    made = [draw(groups(version, seq + i, 44_000 // n)) for i in range(n)]
    assert fits_inline(made), "the strategy must stay inside the inline limit"
    return BucketEntry.of_groups(made)


@st.composite
def pointers(draw, kind: str = "group") -> BlobPointer:
    return BlobPointer(
        sha256=draw(sha256s),
        size=draw(st.integers(1, MAX_GROUP_BATCH_BYTES if kind == "group" else MAX_BLOB_BYTES)),
        providers=draw(sized(peer_ids, MAX_PROVIDERS, min_size=1, distinct=distinct_peer_id)),
        kind=kind,
    )


@st.composite
def pointer_entries(draw) -> BucketEntry:
    return BucketEntry.of_pointer(
        draw(pointers()), draw(counts), draw(counts), draw(st.integers(1, MAX_GROUPS_PER_ENTRY))
    )


_BUCKET = dict(
    key=lambda run, entry: keys.bucket_key(run, entry.version),
    subkey=lambda pub, entry: keys.group_subkey(pub, entry.version, entry.seq),
    field=lambda entry: keys.bucket_field(keys.bucket_slot(entry.version)),
)


def _group_fields(g: tuple) -> dict:
    """Out-of-range mutations of the group at path ``g`` inside an entry."""

    def tokens(n):
        return encode_tokens([1] * n)

    return {
        "empty prompt": set_at(g + ("prompt_ids",), fixed(b"")),
        "prompt too long": set_at(g + ("prompt_ids",), fixed(tokens(MAX_PROMPT_TOKENS + 1))),
        "ragged prompt bytes": set_at(
            g + ("prompt_ids",), lambda old: st.integers(1, 3).map(lambda k: old + b"\0" * k)
        ),
        "one completion": lambda d, draw: (
            at(d, g).update(completions=at(d, g)["completions"][:1], rewards=at(d, g)["rewards"][:1]) or True
        ),
        "too many completions": lambda d, draw: (
            at(d, g).update(completions=at(d, g)["completions"][:1] * 65, rewards=[0.0] * 65) or True
        ),
        "empty completion": set_at(g + ("completions", "*"), fixed({"token_ids": b"", "logprobs": b""})),
        "completion too long": set_at(
            g + ("completions", "*"),
            fixed({"token_ids": tokens(1025), "logprobs": encode_floats([-1.0] * 1025)}),
        ),
        "ragged token bytes": set_at(g + ("completions", "*", "token_ids"), lambda old: st.just(old[:-1])),
        "fewer log-probs than tokens": set_at(
            g + ("completions", "*"),
            lambda old: st.just({**old, "token_ids": old["token_ids"] + tokens(1)}),
        ),
        "more log-probs than tokens": set_at(
            g + ("completions", "*", "logprobs"), lambda old: st.just(old + encode_floats([-1.0]))
        ),
        "nan or inf log-prob": set_at(
            g + ("completions", "*", "logprobs"),
            lambda old: st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda x: encode_floats([x]) + old[4:]),
        ),
        "positive log-prob": set_at(
            g + ("completions", "*", "logprobs"),
            lambda old: st.floats(min_value=FLOAT32_TINY, max_value=2.0**100, width=32).map(
                lambda x: encode_floats([x]) + old[4:]
            ),
        ),
        "fewer rewards": lambda d, draw: at(d, g)["rewards"].pop() is not None,
        "more rewards": lambda d, draw: at(d, g)["rewards"].append(0.5) or True,
        "reward out of range": set_at(g + ("rewards", "*"), lambda _: bad_fractions()),
        "group adapter sha256": set_at(g + ("adapter_sha256",), bad_hex),
        "producer": set_at(g + ("producer",), bad_peer_ids),
        "task seed": set_at(g + ("task_seed",), lambda _: bad_counts()),
        "negative group created": set_at(g + ("created",), lambda _: negative_floats()),
    }


def _both_payloads(d, draw):
    d["pointer"] = draw(pointers()).dict()
    return True


def _seq_gap(d, draw):
    if len(d["groups"]) < 2:
        return False
    d["groups"][-1]["seq"] += draw(st.integers(1, 5))
    return True


def _mixed_versions(d, draw):
    if len(d["groups"]) < 2:
        return False
    d["groups"][-1]["version"] = d["groups"][-1]["version"] ^ draw(st.integers(1, 2**20))
    return True


INLINE = Kind(
    name="entry (inline)",
    cls=BucketEntry,
    valid=inline_entries(),
    **_BUCKET,
    out_of_range={
        "count": set_at(("count",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_GROUPS_PER_ENTRY + 1, 2**63)),
        "no groups": set_at(("inline",), fixed(b"")),
        "inline over its limit": set_at(("inline",), fixed(b"\0" * (MAX_INLINE_BATCH_BYTES + 1))),
        "groups as a list": set_at(("inline",), fixed([])),
        "inline and pointer": _both_payloads,
        "neither payload": set_at(("inline",), fixed(None)),
    },
    oversize=lambda d, draw: d.update(inline=b"\0" * (MAX_DHT_VALUE_BYTES + 1)),
)

BATCH_BREAKS: dict[str, Callable] = {
    # label -> mutate(batch_dict, draw), in place; False where the batch cannot take it (one group: no seq gap)
    "seqs not consecutive": _seq_gap,
    "versions differ": _mixed_versions,
    "no groups": set_at(("groups",), fixed([])),
    "too many groups": lambda d, draw: d.update(groups=d["groups"][:1] * (MAX_GROUPS_PER_ENTRY + 1)) or True,
    "newer protocol inside": set_at(("groups", "*", "protocol_version"), lambda old: st.just(old + 1)),
    **_group_fields(("groups", 0)),
}
"""What a batch of groups must not be: ``groups_of`` refuses every one (a DHT node, which stores the batch as
bytes, cannot tell)."""

POINTER = Kind(
    name="entry (pointer)",
    cls=BucketEntry,
    valid=pointer_entries(),
    **_BUCKET,
    out_of_range={
        "count": set_at(("count",), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_GROUPS_PER_ENTRY + 1, 2**63)),
        "inline and pointer": lambda d, draw: d.update(inline=b"\x91") or True,
        "neither payload": set_at(("pointer",), fixed(None)),
        "pointer kind": set_at(("pointer", "kind"), lambda _: st.sampled_from(["adapter", "model-file", "Group", ""])),
        "pointer sha256": set_at(("pointer", "sha256"), bad_hex),
        "group blob size": set_at(
            ("pointer", "size"), lambda _: st.integers(-(2**63), 0) | st.integers(MAX_GROUP_BATCH_BYTES + 1, 2**63)
        ),
        **provider_rules(("pointer", "providers")),
    },
    oversize=lambda d, draw: d["pointer"].update(providers=["Qm" + base58(i, 4) for i in range(OVER // 4)]),
)
