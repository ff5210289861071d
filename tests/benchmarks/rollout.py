"""Rollout peer throughput against a bare ``generate()`` loop: what the swarm's machinery costs.

``hivegrpo host`` runs as a child process; this process holds a real rollout peer
(``peer.roles.rollout.peer.RolloutPeer``, its DHT in a child process of its own) joined to it on loopback, and a
third peer that plays the learner. Rounds go A S B A S B ... A S, so that each B sits between two A's and two S's:

* **A, bare**: ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1, output_scores=True)`` on the
  rollout peer's own model object (nf4 base + LoRA), the same prompts x G rows per batch, the same
  ``max_new_tokens``, with per-token log-probs from ``compute_transition_scores`` (the rollout records them too).
* **S, bare sampler**: the rollout peer's own decode loop (``sample_groups``) on the same batches with nothing
  else running: B against S is what the machinery costs, whatever the decode loop gains or loses on generate().
* **B, rollout**: ``RolloutPeer.run(max_seconds=...)`` — prompt derivation, sampling, scoring, building the
  records, publishing them to the DHT, the heartbeat, the adapter follower and the backlog counter all running,
  while a stand-in learner on the third peer announces a new adapter version every ``--version-interval``
  seconds (so the peer also fetches and hot-swaps adapters, and each version's bucket stays the size it has in
  a run; the bare rounds run under the same announcements).

Completions per second are counted per round from the rows each made (B's groups are all published when its
round returns; the bucket is read back at the end). Reported: every round, and the median ratio of B to the mean
of the A's on either side (target >= 0.9), also without B's end-of-round drain (the wait for its last batch's
linger and store, which a continuous run overlaps with the next batch)::

    python -m tests.benchmarks.rollout --seconds 8 --rounds 3 --batch-size 16 --out rollout.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def bare_round(peer, prompts: list[str], seconds: float) -> tuple[int, float]:
    """Rows generated (with their log-probs) by back-to-back generate() calls for about ``seconds``."""
    import torch

    s = peer.spec.sampling
    tok = peer.tokenizer
    repeated = [p for p in prompts for _ in range(s.group_size)]
    batch = tok(repeated, return_tensors="pt", padding=True).to(peer.device)
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        with torch.no_grad():
            out = peer.model.generate(
                **batch,
                do_sample=True,
                temperature=s.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=s.max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            logprobs = peer.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        assert logprobs.shape[0] == len(repeated)
        rows += len(repeated)
    return rows, time.perf_counter() - start


def sampler_round(peer, prompts: list[str], seconds: float) -> tuple[int, float]:
    """Rows made by back-to-back calls of the rollout peer's own sampler (``sample_groups``, the decode loop
    ``RolloutPeer.run`` uses) with nothing else: the machinery's cost alone, whatever generate() costs."""
    import torch

    from peer.model.sampling import sample_run

    s = peer.spec.sampling
    generator = torch.Generator(device=peer.device)
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        generator.manual_seed(rows)
        batch = sample_run(
            peer.model, peer.tokenizer, prompts, s, peer.spec.prompt, device=peer.device, generator=generator
        )
        rows += batch.completion_ids.shape[0]
    return rows, time.perf_counter() - start


def adapter_versions(v0: bytes, n: int) -> list[bytes]:
    """``n`` successive adapters made from v0 by small seeded perturbations (what a learner would announce)."""
    import torch
    from safetensors.torch import load, save

    from peer.model.adapter import METADATA_KEY, blob_lora_config

    lora = blob_lora_config(v0).to_dict()
    lora.pop("init_seed")
    tensors = load(v0)
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tensors = {k: t + 1e-3 * torch.randn(t.shape, generator=generator) for k, t in tensors.items()}
        out.append(save(tensors, metadata={METADATA_KEY: json.dumps(lora, sort_keys=True)}))
    return out


def start_host(tmp: Path, run_id: str) -> subprocess.Popen:
    """``hivegrpo host`` on loopback in a child process (the coordinator package is not imported here)."""
    info = tmp / "info.json"
    command = [sys.executable, "-m", "peer.cli", "host", "--run-id", run_id, "--cache-dir", str(tmp / "host")]
    command += ["--info-file", str(info), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-relay"]
    host = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(tmp / "host.log", "w"))  # noqa: SIM115
    deadline = time.time() + 120
    while not info.exists():
        if host.poll() is not None or time.time() > deadline:
            host.kill()
            raise RuntimeError(f"the host did not start: {(tmp / 'host.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return host


class StandInLearner:
    """Announces a new adapter version every ``interval`` seconds from its own peer, as a learner would; keeps
    each version's bucket the size it has in a real run (otherwise one bucket would grow without bound). It
    heartbeats as a learner, so the rollout peer reads the learners' heartbeats for its pushes as in a run (with
    three peers every node replicates every key, so no entry goes anywhere but to the replicas)."""

    def __init__(self, swarm, blobs, v0: bytes, interval: float, versions: int, credential: str):
        import threading

        self.swarm, self.blobs_service, self.interval = swarm, blobs, interval
        self.credential = credential  # the host's learner credential: followers take admitted learners' versions
        self.blobs = adapter_versions(v0, versions)
        self.parent = hashlib.sha256(v0).hexdigest()
        self.version = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StandInLearner:
        from peer.network.admission import keep_admitted, parse_credential
        from peer.network.heartbeat import Heartbeat

        self.heartbeat = Heartbeat(self.swarm, "learner").start()
        keep_admitted(self.swarm, self.heartbeat, parse_credential(self.credential))
        self._thread.start()
        return self

    def _run(self) -> None:
        from peer.run.adapters import announce_adapter

        while not self._stop.wait(self.interval) and self.version < len(self.blobs):
            blob = self.blobs[self.version]
            self.version += 1
            announce_adapter(self.swarm, self.blobs_service, self.version, blob, self.parent)
            self.parent = hashlib.sha256(blob).hexdigest()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.heartbeat.stop()


def rollout_round(peer, seconds: float) -> dict:
    """Completions made and published by the rollout loop in about ``seconds``, and where its time went: decoding,
    the sampler's whole batches (decoding + handing the batch over), the end-of-round drain (waiting for the last
    batch's linger and store, which a continuous run overlaps with the next batch), and the publisher thread's
    scoring and record building (concurrent with decoding)."""
    stats = peer.stats
    before = (stats["completions"], stats["sample_s"], stats["decode_s"], peer.drain_seconds)
    scored = peer.publisher.prepare_seconds
    start = time.perf_counter()
    peer.run(max_seconds=seconds)
    secs = time.perf_counter() - start
    return {
        "completions": stats["completions"] - before[0],
        "seconds": round(secs, 3),
        "sampling_seconds": round(stats["sample_s"] - before[1], 3),
        "decode_seconds": round(stats["decode_s"] - before[2], 3),
        "drain_seconds": round(peer.drain_seconds - before[3], 3),
        "scoring_seconds": round(peer.publisher.prepare_seconds - scored, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind (interleaved)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per batch (x G = 8 rows)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--linger", type=float, default=0.25, help="the rollout publisher's gathering time")
    parser.add_argument("--version-interval", type=float, default=1.0, help="seconds between new adapter versions")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    from peer.model.adapter import adapter_to_bytes
    from peer.network.blobs import BlobCache, BlobService
    from peer.network.buckets import DHTBucketStore
    from peer.network.swarm import NetworkConfig, join
    from peer.roles.rollout.peer import RolloutConfig, RolloutPeer

    run_id = "bench-rollout"
    with tempfile.TemporaryDirectory() as tmp:
        host, peer, announcer = start_host(Path(tmp), run_id), None, None
        try:
            info = json.loads((Path(tmp) / "info.json").read_text())
            config = RolloutConfig(
                run_id=run_id,
                network=NetworkConfig.loopback(info["initial_peers"]),
                coordinator=info["coordinator"],
                cache_dir=Path(tmp) / "rollout",
                device="cpu",
                batch_size=args.batch_size,
                max_inflight=10**9,
                publish_linger=args.linger,
            )
            peer = RolloutPeer(config).start()
            announcer = join(NetworkConfig.loopback(info["initial_peers"]), run_id)
            blobs = BlobService(announcer.dht, BlobCache(Path(tmp) / "learner"))
            prompts = [peer.spec.task.example(0, i).prompt for i in range(args.batch_size)]
            total = (3 * args.rounds + 2) * args.seconds + 10
            v0 = adapter_to_bytes(peer.model)
            learner = StandInLearner(
                announcer,
                blobs,
                v0,
                args.version_interval,
                int(total / args.version_interval),
                info["learner_credential"],
            )
            learner.start()
            bare_round(peer, prompts, 1.0)  # warm-up of every path, not counted
            sampler_round(peer, prompts, 1.0)
            rollout_round(peer, 1.0)
            rounds = []
            for i in range(args.rounds + 1):  # each rollout round sits between two rounds of each bare kind
                for kind, measure in (("bare", bare_round), ("sampler", sampler_round)):
                    rows, secs = measure(peer, prompts, args.seconds)
                    rounds.append({"kind": kind, "round": i, "completions": rows, "seconds": round(secs, 3)})
                if i < args.rounds:
                    rounds.append({"kind": "rollout", "round": i, **rollout_round(peer, args.seconds)})
            learner.stop()
            time.sleep(2.0)  # the last stores were acknowledged by the first replica; let the rest land
            window = (max(0, peer.version - 40), peer.version)  # well inside the ring of readable versions
            in_buckets = DHTBucketStore(announcer).count(*window)
            in_window = peer.backlog.enqueued_in(*window)
            published = peer.publisher.published
            swaps, swap_ms = peer.stats["swaps"], 1000 * statistics.median(peer.swap_seconds or [0.0])
            blobs.close()
        finally:
            if peer is not None:
                peer.close()
            if announcer is not None:
                announcer.shutdown()
            host.send_signal(signal.SIGTERM)
            try:
                host.wait(timeout=30)
            except subprocess.TimeoutExpired:
                host.kill()
                host.wait()

    for r in rounds:
        r["per_second"] = round(r["completions"] / r["seconds"], 1)
        if r["kind"] == "rollout":
            r["per_second_steady"] = round(r["completions"] / (r["seconds"] - r["drain_seconds"]), 1)
    bare = [r["per_second"] for r in rounds if r["kind"] == "bare"]
    sampler = [r["per_second"] for r in rounds if r["kind"] == "sampler"]
    roll = [r["per_second"] for r in rounds if r["kind"] == "rollout"]
    steady = [r["per_second_steady"] for r in rounds if r["kind"] == "rollout"]
    # against the mean of the bare rounds just before and just after: a machine whose speed drifts during the run
    # (a shared one does) biases neither kind
    around = [(bare[i] + bare[i + 1]) / 2 for i in range(len(roll))]
    around_sampler = [(sampler[i] + sampler[i + 1]) / 2 for i in range(len(roll))]
    ratios = [b / a for a, b in zip(around, roll, strict=True)]
    steady_ratios = [b / a for a, b in zip(around, steady, strict=True)]
    sampler_ratios = [b / a for a, b in zip(around_sampler, roll, strict=True)]
    result = {
        "rounds": rounds,
        "bare_median": statistics.median(bare),
        "sampler_median": statistics.median(sampler),
        "rollout_median": statistics.median(roll),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(x, 3) for x in ratios],
        "steady_ratio_median": round(statistics.median(steady_ratios), 3),
        "steady_ratios": [round(x, 3) for x in steady_ratios],
        "sampler_ratio_median": round(statistics.median(sampler_ratios), 3),
        "sampler_ratios": [round(x, 3) for x in sampler_ratios],
        "groups_published": published,
        "groups_in_buckets": in_buckets,
        "groups_published_in_window": in_window,
        "window_versions": list(window),
        "adapter_swaps": swaps,
        "swap_ms_median": round(swap_ms, 2),
        "version_interval": args.version_interval,
        "publish_linger": args.linger,
        "batch_size": args.batch_size,
        "group_size": 8,
        "threads": args.threads,
        "seconds_per_round": args.seconds,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    rolls = [r for r in rounds if r["kind"] == "rollout"]
    share = {k: [r[f"{k}_seconds"] / r["seconds"] for r in rolls] for k in ("decode", "sampling", "drain", "scoring")}
    for k, values in share.items():
        result[f"rollout_{k}_fraction"] = [round(x, 3) for x in values]
    print(
        f"{'round':>5}  {'bare generate() /s*':>19}  {'rollout peer /s':>16}  {'ratio':>6}  {'w/o drain':>9}  "
        f"{'bare sampler /s*':>16}  {'ratio':>6}  {'decoding':>8}  {'+ hand-over':>11}  {'drain':>6}  "
        f"{'scoring (child)':>15}"
    )
    for i, (a, b) in enumerate(zip(around, roll, strict=True)):
        print(
            f"{i:>5}  {a:>19.1f}  {b:>16.1f}  {b / a:>6.3f}  {steady[i] / a:>9.3f}  {around_sampler[i]:>16.1f}  "
            f"{sampler_ratios[i]:>6.3f}  {share['decode'][i]:>8.1%}  {share['sampling'][i]:>11.1%}  "
            f"{share['drain'][i]:>6.1%}  {share['scoring'][i]:>15.1%}"
        )
    print(
        f"median ratio {result['ratio_median']:.3f}, without the end-of-round drain "
        f"{result['steady_ratio_median']:.3f} (target >= 0.9); against the bare sampler "
        f"{result['sampler_ratio_median']:.3f}; {published} groups published, "
        f"{in_buckets} of the {in_window} of v{window[0]}-v{window[1]} read back from the buckets; "
        f"{swaps} adapter swaps (median {swap_ms:.1f} ms); "
        f"batch {args.batch_size} x 8, {args.threads} thread(s); * mean of the rounds of that kind before and after"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
