"""A peer that floods the buckets: valid-looking groups, as many per second as asked, sampled from nothing.

Usage: python tests/procs/flooder.py OUT.json RATE --run-id ID --coordinator FP --initial-peers MADDR...
       [--identity FILE]

It joins the run like any peer (its own signing key), follows the newest announced adapter version, and publishes
``RATE`` groups a second under its own key: each with the prompt the learners expect for its seq, made-up
completions scored honestly (so the reward check passes) and made-up behaviour log-probs (it samples nothing — the
log-prob spot check is what can tell). Each bucket entry points to a blob of 64 groups that this peer serves — the
cheapest flood to make and to store (the DHT holds and validates only small pointers) and the dearest to read: a
learner must fetch and parse every blob, until it bans the signer. Groups are built without running the schema's
validators (every reader does); entries expire after 600 s like a rollout peer's. On SIGTERM it writes
``{"published", "seconds", "rate"}`` to ``OUT.json`` and exits 0.
"""

import argparse
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PER_ENTRY = 64  # groups per bucket entry (the most one may hold), as a blob the entry points to


@functools.lru_cache(maxsize=64)
def _decode(tokenizer, tokens: tuple[int, ...]) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


def made_up_group(spec, tokenizer, owner: bytes, producer: str, seq: int, version: int, sha: str, check=True):
    """A group that passes every check but the log-prob spot check (see the module docstring). ``check=False``
    builds it without running the schema's validators (the flooder's speed; every receiving peer validates)."""
    from peer.protocol import Completion, GroupRecord, encode_floats, encode_tokens
    from peer.run.spec import prompt_seed
    from tests.helpers.records import make_group

    example = spec.example(owner, seq)
    completions = [[1 + (seq + i) % 9, 2] for i in range(spec.sampling.group_size)]
    # the first completion answers right: groups whose rewards are all equal would be dropped as without signal
    # before any check that could catch the flood
    answer = tokenizer(example.reference, add_special_tokens=False)["input_ids"][: spec.sampling.max_new_tokens - 1]
    completions[0] = [*answer, 2]
    rewards = [spec.task.reward(_decode(tokenizer, tuple(c)), example) for c in completions]
    prompt = tokenizer(example.prompt)["input_ids"]
    fields = dict(
        version=version,
        adapter_sha256=sha,
        producer=producer,
        seq=seq,
        task_seed=prompt_seed(spec.seed, owner),
        task_index=seq,
        rewards=[float(r) for r in rewards],
        created=time.time(),
    )
    if check:
        return make_group(**fields, prompt=prompt, completions=completions, logprob=-0.5)
    made = [
        Completion.construct(token_ids=encode_tokens(c), logprobs=encode_floats([-0.5] * len(c))) for c in completions
    ]
    return GroupRecord.construct(
        **fields,
        prompt_ids=encode_tokens(prompt),
        completions=made,
        protocol_version=GroupRecord.__fields__["protocol_version"].default,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("rate", type=float)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--initial-peers", action="append", default=[])
    parser.add_argument("--identity", default=None)
    args, _ = parser.parse_known_args()

    from peer.model.loading import bundled_path, load_tokenizer
    from peer.network.blobs import BlobCache, BlobService
    from peer.network.swarm import NetworkConfig, join
    from peer.protocol import (
        PROTOCOL_VERSION,
        BlobPointer,
        BucketEntry,
        GroupBatch,
        bucket_key,
        group_subkey,
        pack,
        to_dht_value,
    )
    from peer.run.adapters import announcements, newest_announcement
    from peer.run.spec import read_manifest, run_spec

    swarm = join(NetworkConfig.loopback(args.initial_peers, identity_path=args.identity), args.run_id)
    blobs = BlobService(swarm.dht, BlobCache(Path(args.out).with_suffix(".blobs")))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    published, started = 0, time.time()
    try:
        manifest, key = read_manifest(swarm, args.coordinator)
        spec = run_spec(manifest, key)
        tokenizer = load_tokenizer(str(bundled_path()))
        owner, producer = swarm.public_key, str(swarm.peer_id)
        version, sha, looked, seq = 0, manifest.adapter0_sha256, 0.0, 0
        started = time.time()
        while not stop.is_set():
            now = time.time()
            if now - looked > 1.0:
                found = newest_announcement(announcements(swarm))
                if found is not None and found.version > version:
                    version, sha = found.version, found.sha256
                looked = now
            due = int(args.rate * (now - started)) - published
            if due <= 0:
                stop.wait(0.01)
                continue
            items = []
            for _ in range(min(16, -(-due // PER_ENTRY))):  # up to 16 entries per store, stored concurrently
                groups = [
                    made_up_group(spec, tokenizer, owner, producer, seq + i, version, sha, False)
                    for i in range(PER_ENTRY)
                ]
                data = pack(GroupBatch.construct(protocol_version=PROTOCOL_VERSION, groups=groups))
                pointer = BlobPointer(
                    sha256=blobs.cache.put_bytes(data), size=len(data), providers=[producer], kind="group"
                )
                entry = BucketEntry.of_pointer(pointer, version, seq, PER_ENTRY)
                key = bucket_key(swarm.run_id, version)
                items.append((key, group_subkey(owner, version, seq), to_dht_value(entry), time.time() + 600.0))
                seq += PER_ENTRY
            swarm.store_many(items, "flood", all_replicas=False)
            published += PER_ENTRY * len(items)
    finally:
        seconds = time.time() - started
        stats = {"published": published, "seconds": seconds, "rate": published / seconds}
        Path(args.out).write_text(json.dumps(stats))
        blobs.close()
        swarm.shutdown()


if __name__ == "__main__":
    main()
