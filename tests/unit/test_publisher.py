"""The rollout publisher's child process: scoring there, entries stored here, gathering, errors, shutdown."""

import hashlib
import os
import signal
import time

import pytest
import torch

from peer.model.sampling import Completions
from peer.network.buckets import MemoryBucketStore
from peer.roles.rollout.publisher import Publisher, Sampled
from tests.helpers.records import adapter_sha, make_group

OWNER = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/owner=="
SHA = adapter_sha(1)


class Store(MemoryBucketStore):
    """A memory bucket store that records each ``store_entries`` call and where it ran."""

    def __init__(self):
        super().__init__(OWNER)
        self.calls: list[tuple[int, list[int]]] = []

    def store_entries(self, entries):
        self.calls.append((os.getpid(), [g.seq for g in entries]))
        super().store_entries(entries)


def base58(text: str) -> str:
    """``text`` of digits and hex letters as a valid producer field (base58 has no 0)."""
    return text.replace("0", "z")


def pid_groups(sampled):
    """Scoring stand-in: one group per seq, named after the process that made it."""
    return [make_group(version=1, seq=seq, producer=base58(f"pid{os.getpid()}")) for seq in sampled.seqs]


def sampled(seq0: int, n: int, batch=None) -> Sampled:
    return Sampled(batch=batch, examples=[], seqs=range(seq0, seq0 + n), version=1, sha=SHA)


def test_batches_are_scored_in_the_child_and_stored_here_gathered_into_one_call():
    store = Store()
    publisher = Publisher(store, 4, pid_groups, linger=0.5)
    try:
        for seq0 in (0, 3, 6):  # handed over within the linger: one store of nine groups
            publisher.put(sampled(seq0, 3))
        publisher.flush()
        assert publisher.published == 9 and publisher.failed == 0 and publisher.prepare_seconds > 0
        assert store.calls == [(os.getpid(), list(range(9)))]
        producers = {f.group.producer for f in store.fetch(1, 1)}
        assert producers == {base58(f"pid{publisher.pid}")} and publisher.pid != os.getpid()
    finally:
        publisher.close()
    assert publisher._process.exitcode == 0


def test_flush_ends_the_gathering_at_once():
    store = Store()
    publisher = Publisher(store, 4, pid_groups, linger=30.0)
    try:
        publisher.put(sampled(0, 2))
        start = time.monotonic()
        publisher.flush()  # without the flush message the child would wait out its 30 s linger
        assert time.monotonic() - start < 5.0 and publisher.published == 2
    finally:
        publisher.close()


def test_a_callable_linger_is_asked_at_each_hand_over_and_the_first_batch_sets_the_gathering():
    store = Store()
    lingers = [0.0, 0.0, 30.0, 0.0]  # the third batch starts a gathering of 30 s that the fourth joins
    publisher = Publisher(store, 8, pid_groups, linger=lambda: lingers.pop(0))
    try:
        for seq0 in (0, 2):  # no linger: one store each
            publisher.put(sampled(seq0, 2))
            deadline = time.monotonic() + 10
            while publisher.published < seq0 + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        publisher.put(sampled(4, 2))
        publisher.put(sampled(6, 2))
        time.sleep(0.5)
        assert publisher.published == 4, "the third batch waits out its linger, gathering the fourth"
        publisher.flush()
        assert store.calls == [(os.getpid(), [0, 1]), (os.getpid(), [2, 3]), (os.getpid(), [4, 5, 6, 7])]
        assert lingers == [], "asked once per batch"
    finally:
        publisher.close()


def test_a_sampled_batch_reaches_the_child_with_its_tensors_intact():
    batch = Completions(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[3, 4], [4, 2]]),
        completion_mask=torch.tensor([[True, False], [True, True]]),
        logprobs=torch.tensor([[-0.5, 0.0], [-0.25, -1.5]]),
    )

    def digest(completions) -> str:
        fields = sorted((k, str(v.dtype), v.tolist()) for k, v in vars(completions).items())
        return base58(hashlib.sha256(repr(fields).encode()).hexdigest())

    expected = digest(batch)

    def echo(item):  # a digest of the tensors as the child got them, in the producer field
        return [make_group(version=1, seq=seq, producer=digest(item.batch)) for seq in item.seqs]

    store = Store()
    publisher = Publisher(store, 4, echo)
    try:
        publisher.put(sampled(0, 2, batch))
        publisher.flush()
    finally:
        publisher.close()
    assert [f.group.producer for f in store.fetch(1, 1)] == [expected, expected]


def test_a_task_whose_reward_raises_stops_the_sampler_loudly():
    def prepare(item):
        if item.seqs.start == 2:
            raise ValueError("reward() of a broken task")
        return pid_groups(item)

    store = Store()
    publisher = Publisher(store, 4, prepare)
    try:
        publisher.put(sampled(0, 2))
        publisher.put(sampled(2, 2))
        publisher.flush()  # returns: the broken batch is counted done, not left pending
        assert publisher.published == 2 and isinstance(publisher.error, ValueError)
        with pytest.raises(ValueError, match="broken task"):
            publisher.put(sampled(4, 2))
        with pytest.raises(ValueError, match="broken task"):
            publisher.check()
    finally:
        publisher.close()
    assert sorted(seq for (_, _, seq) in store.entries) == [0, 1]


def test_groups_that_cannot_become_entries_are_counted_failed_and_publishing_goes_on():
    class Picky(Store):
        def entries_of(self, groups):
            if groups[0].seq == 2:
                raise ValueError("groups 1.2+2 are too large to publish inline")
            return super().entries_of(groups)

    store = Picky()
    publisher = Publisher(store, 4, pid_groups)
    try:
        for seq0 in (0, 2, 4):
            publisher.put(sampled(seq0, 2))
            publisher.flush()
        assert (publisher.published, publisher.failed, publisher.error) == (4, 2, None)
        assert "too large" in publisher.last_error
    finally:
        publisher.close()


def test_a_publisher_process_that_dies_is_a_clear_error_not_a_hang():
    def slow(item):  # scoring that is still busy when the child is killed
        time.sleep(30)
        return pid_groups(item)

    publisher = Publisher(Store(), 4, slow)
    try:
        publisher.put(sampled(0, 2))
        os.kill(publisher.pid, signal.SIGKILL)
        start = time.monotonic()
        publisher.flush()  # the batch in the dead child will never be answered
        assert time.monotonic() - start < 10.0
        with pytest.raises(RuntimeError, match="stopped unasked, exit code -9, with 1 sampled batch"):
            publisher.check()
        with pytest.raises(RuntimeError, match="stopped unasked"):
            publisher.put(sampled(2, 2))
    finally:
        publisher.close()


def test_the_child_ignores_sigint_and_exits_when_the_peer_closes_it():
    publisher = Publisher(Store(), 4, pid_groups)
    os.kill(publisher.pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group
    publisher.put(sampled(0, 2))
    publisher.flush()
    assert publisher.published == 2
    publisher.close()
    publisher.close()  # idempotent
    assert publisher._process.exitcode == 0
