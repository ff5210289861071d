"""Memory on the rollout side (peer/model/memory.py, RolloutPeer.sample): the per-row estimate against a measured
peak, the batch size it gives under --max-memory, and the back-off when memory runs out — by an injected sampler
that raises CUDA's OutOfMemoryError above a size, and by a real budget too small for the batch."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peer.errors import UserError
from peer.model import memory
from peer.model.memory import (
    auto_batch_size,
    in_batches,
    memory_budget,
    model_bytes,
    parse_memory,
    retry_halving,
    row_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
ESTIMATE_FACTOR = 3.0  # the estimate is at least the measured peak per row and at most this many times it
OWNER = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7+/memory=="


def test_max_memory_reads_decimal_and_binary_units_and_refuses_anything_else():
    assert parse_memory("800MB") == 800 * 10**6
    assert parse_memory("6GiB") == 6 * 2**30
    assert parse_memory("1.5 gb") == 1_500_000_000
    assert parse_memory("4096") == 4096
    for bad in ("lots", "", "6 GiBs", "-1GB", "0"):
        with pytest.raises(ValueError, match="must look like 800MB or 6GiB|at least one byte"):
            parse_memory(bad)
    with pytest.raises(ValueError, match=r"--max-memory must look like 800MB or 6GiB, got 'lots'"):
        parse_memory("lots")


def test_max_memory_on_the_command_line(monkeypatch):
    from click.testing import CliRunner

    from peer.cli import main
    from peer.roles.rollout import peer as rollout

    seen = []
    done = SimpleNamespace(to_json=dict)  # the summary the command prints with --json
    monkeypatch.setattr(rollout, "run_rollout", lambda config, on_ready: seen.append(config) or done)
    out = CliRunner().invoke(main, ["join", "--run-id", "r", "--max-memory", "6GiB", "--json"])
    assert out.exit_code == 0, out.output
    assert seen[-1].max_memory == 6 * 2**30
    out = CliRunner().invoke(main, ["join", "--run-id", "r", "--max-memory", "lots"])
    assert out.exit_code == 2 and "--max-memory must look like 800MB or 6GiB, got 'lots'" in out.output
    with pytest.raises(ValueError, match="max_memory must be a positive number of bytes"):
        rollout.RolloutConfig(run_id="r", max_memory=0)


# ------------------------------------------------------------------------------------------------ the estimate


@pytest.mark.parametrize(
    "rows, prompt, new, dtype, vocab",
    [
        (16, 200, 8, "bfloat16", 32000),  # long prompts at 16 bits: the prefill and the cache
        (16, 16, 8, "float32", 150000),  # a large vocabulary: the decode step's float32 logits dominate
    ],
)
def test_the_row_estimate_bounds_the_measured_peak(rows, prompt, new, dtype, vocab):
    """The sampler's own decode loop on a model built from a config, in a fresh process: its peak resident memory
    rises by at most the estimate per row, and by more than a third of it.

    glibc's malloc moves its mmap threshold as large blocks are freed; blocks then carved from the heap leave holes
    whose size depends on the allocator's history, not the batch. A fixed threshold (MALLOC_MMAP_THRESHOLD_) makes
    every large tensor its own mapping, so the peak measured is what torch holds. (Without it, one 16-row batch
    measured 1.04x the estimate: the budget's share of free memory is the margin for that.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT))
    script = ROOT / "tests" / "procs" / "decode_peak.py"
    args = [str(a) for a in (rows, prompt, new, dtype, vocab)]
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    measured = result["rise"] / rows
    estimate = row_bytes(SimpleNamespace(**result["config"]), getattr(torch, dtype), prompt, new)
    assert measured <= estimate <= ESTIMATE_FACTOR * measured, (measured / 2**20, estimate / 2**20)


def _module(vocab: int = 100, dtype=torch.float32) -> torch.nn.Module:
    module = torch.nn.Embedding(vocab, 64).to(dtype)
    module.config = SimpleNamespace(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab
    )
    return module


def test_the_estimate_is_at_the_models_dtype_and_grows_with_every_term():
    c = _module().config
    full, half = row_bytes(c, torch.float32, 10, 6), row_bytes(c, torch.bfloat16, 10, 6)
    assert half < full
    assert row_bytes(c, torch.float32, 20, 6) > full and row_bytes(c, torch.float32, 10, 12) > full
    wide = SimpleNamespace(**{**vars(c), "vocab_size": 10**5})
    assert row_bytes(wide, torch.float32, 10, 6) - full >= 8 * (10**5 - 100) * 4, "float32 logits per vocab entry"


def test_auto_batch_size_follows_free_ram_or_max_memory(monkeypatch):
    import psutil

    model, cpu, G, p, m = _module(), torch.device("cpu"), 8, 10, 6
    per_prompt = G * row_bytes(model.config, torch.float32, p, m)
    for available, expected in [(4 * per_prompt * 5, 5), (4 * per_prompt * 5 - 1, 4), (0, 1), (2**50, 16)]:
        monkeypatch.setattr(psutil, "virtual_memory", lambda a=available: SimpleNamespace(available=a))
        assert auto_batch_size(model, cpu, G, p, m) == expected
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**40))
    held = model_bytes(model)
    assert held == 100 * 64 * 4
    assert auto_batch_size(model, cpu, G, p, m, max_memory=held + 3 * per_prompt) == 3
    assert auto_batch_size(model, cpu, G, p, m, max_memory=held + 3 * per_prompt - 1) == 2
    with pytest.raises(UserError, match="the model alone takes .* raise --max-memory"):
        auto_batch_size(model, cpu, G, p, m, max_memory=held)
    bf16 = _module(dtype=torch.bfloat16)
    assert bf16.weight.dtype == torch.bfloat16
    assert memory_budget(bf16, cpu, 10**6)[0] == 10**6 - 100 * 64 * 2


# ------------------------------------------------------------------------------------------------ the back-off


def _oom_above(limit: int, calls: list):
    def work(start: int, stop: int):
        calls.append((start, stop))
        if stop - start > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {stop - start} GiB")
        return list(range(start, stop))

    return work


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_running_out_of_memory_halves_the_batch_and_retries_the_same_items():
    calls, said, log = [], _Said(), memory.logger
    log.addHandler(said)
    try:
        done, size = in_batches(_oom_above(3, calls), 16, 16)
    finally:
        log.removeHandler(said)
    assert size == 2, "halved from 16 until a batch fit, and that size is the one kept"
    assert [i for chunk in done for i in chunk] == list(range(16)), "every item once, in order"
    assert calls[:4] == [(0, 16), (0, 8), (0, 4), (0, 2)]
    assert said.lines == [
        "out of memory at 16 prompts per batch; halving to 8",
        "out of memory at 8 prompts per batch; halving to 4",
        "out of memory at 4 prompts per batch; halving to 2",
    ], "one line per halving"


def test_memory_errors_of_the_cpu_back_off_too_and_other_errors_propagate():
    def cpu_failure(start, stop):
        if stop - start > 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        return start

    def python_failure(start, stop):
        if stop - start > 2:
            raise MemoryError()
        return start

    assert in_batches(cpu_failure, 3, 4) == ([0, 1, 2], 1)
    assert in_batches(python_failure, 4, 8) == ([0, 2], 2)

    def broken(start, stop):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        in_batches(broken, 4, 4)


def test_out_of_memory_at_one_prompt_says_what_to_do():
    with pytest.raises(UserError, match=r"out of memory at 1 prompts per batch: .*--max-memory.*--quantization nf4"):
        in_batches(_oom_above(0, []), 4, 4)

    def step(tokens):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(UserError, match="out of memory at 8 tokens: less"):
        retry_halving(step, 64, floor=8, what="tokens", advice="less")


@pytest.fixture(scope="module")
def peer():
    """A rollout peer's sampling parts without a network: the bundled model (nf4) with LoRA, a run's spec."""
    from coordinator.manifest import RunSettings, build_manifest
    from peer.model.adapter import attach_lora
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.loading import bundled_path, load_base
    from peer.roles.rollout.peer import RolloutConfig, RolloutPeer
    from peer.run.spec import run_spec

    manifest = build_manifest(RunSettings(run_id="memory"), bundled_path(), "0" * 64, "12D3KooWmemory")
    base = load_base(ModelConfig(name="bundled", quantization="nf4", device="cpu"))
    p = RolloutPeer(RolloutConfig(run_id="memory"))
    p.spec, p.tokenizer, p.device = run_spec(manifest, OWNER), base.tokenizer, base.device
    p.model = attach_lora(base.model, LoRAConfig())
    p.swarm = SimpleNamespace(public_key=OWNER)
    return p


def _sample(peer, seqs: range, batch_size: int):
    peer.batch_size = batch_size
    examples = [peer.spec.example(OWNER, s) for s in seqs]
    return peer.sample(examples, seqs, torch.Generator())


def test_a_rollout_peer_backs_off_from_a_sampler_that_runs_out_of_memory_and_keeps_the_size(peer, caplog):
    from peer.model.sampling import sample_groups

    tried = []

    def sampler(model, tokenizer, prompts, **kw):
        tried.append(len(prompts))
        if len(prompts) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return sample_groups(model, tokenizer, prompts, **kw)

    peer.sampler = sampler
    try:
        parts = _sample(peer, range(100, 112), 12)
    finally:
        peer.sampler = sample_groups
    assert peer.batch_size == 3 and tried == [12, 6, 3, 3, 3, 3]
    assert [list(r) for r, _ in parts] == [[100, 101, 102], [103, 104, 105], [106, 107, 108], [109, 110, 111]]
    G = peer.spec.sampling.group_size
    # each part is what a batch of that size samples on its own: seeded by its first seq, the same prompts
    again = _sample(peer, range(103, 106), 3)
    assert torch.equal(again[0][1].completion_ids, parts[1][1].completion_ids)
    assert all(batch.completion_ids.shape[0] == 3 * G for _, batch in parts)


def test_a_rollout_peer_halves_a_batch_whose_estimate_exceeds_max_memory(peer):
    """A real, forced budget: --max-memory leaves room for the estimate of 2 prompts' groups (not 3)."""
    from peer.model.memory import compute_dtype
    from peer.roles.rollout.peer import RolloutConfig

    s = peer.spec.sampling
    longest = peer._prompt_tokens([peer.spec.example(OWNER, i).prompt for i in range(50, 58)])
    per_prompt = s.group_size * row_bytes(peer.model.config, compute_dtype(peer.model), longest, s.max_new_tokens)
    config = peer.config
    peer.config = RolloutConfig(run_id="memory", max_memory=model_bytes(peer.model) + 2 * per_prompt + per_prompt // 2)
    try:
        assert peer._auto_batch() <= 2
        parts = _sample(peer, range(50, 58), 8)
        assert peer.batch_size == 2 and [len(r) for r, _ in parts] == [2, 2, 2, 2]
        peer.config = RolloutConfig(run_id="memory", max_memory=model_bytes(peer.model) + per_prompt // 2)
        with pytest.raises(
            UserError, match=r"out of memory at 1 prompts per batch \(estimated .* --max-memory leaves"
        ):
            _sample(peer, range(60, 64), 4)
    finally:
        peer.config = config
