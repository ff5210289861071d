"""Learner throughput on a full bucket against a bare loss + step loop on the same batches: what intake costs.

``hivegrpo host`` (with ``--tau-max`` wide enough that nothing turns stale during the run) and ``hivegrpo join``
run as child processes; the rollout peer fills the bucket of version 0 with ``--groups`` groups and exits (the
host's DHT node keeps the entries), so no producer competes for the CPU or adds groups. A group whose rewards are all
equal never takes an update's slot, so the run makes at most one version per 16 groups with signal (the fill is twice
the groups the versions need; about a quarter of the bundled model's groups at v0 have none). This process then holds
a real learner (``peer.roles.learner.peer.LearnerPeer``, its DHT in a child process of its own; the producer counted as
proven, past its probation, as in a run's steady state) and times
:meth:`~peer.roles.learner.peer.LearnerPeer.run` for ``--versions`` versions:
reading the buckets from the DHT, verifying every group (prompt re-derived, reward recomputed), the sampled
log-prob checks, batching, the clipped-loss AdamW step, serializing and hashing each adapter, the announcements.

The bare loop then replays exactly the groups each of those updates used, in the same order, from the same
starting adapter (v0) with a fresh AdamW: :func:`~peer.roles.learner.update.batch_tensors` +
:func:`~peer.roles.learner.peer.learn_step` and nothing else, on the same model object and threads. It runs
``--bare-rounds`` times; the ratio is learner groups/s over the median bare groups/s (target >= 0.9), over the
whole run and from the end of the first update on (the first update waits for the first read of the buckets). The bare
loop ends at the same adapter bytes as the learner (checked, reported as ``same_adapter``), so both did the same
arithmetic::

    OMP_NUM_THREADS=2 python -m tests.benchmarks.learner --threads 2 --out learner.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.helpers.waiting import children as processes
from tests.helpers.waiting import wait_until

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--versions", type=int, default=24, help="versions the learner makes (16 groups with signal each), at most"
    )
    parser.add_argument("--groups", type=int, default=None, help="groups in the bucket (default 32 x versions)")
    parser.add_argument("--bare-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    groups = args.groups or 2 * 16 * args.versions  # about a quarter of the groups at v0 carry no signal
    tau_max = min(61, args.versions + 1)

    import torch

    torch.set_num_threads(args.threads)
    from peer.model.adapter import adapter_to_bytes, lora_parameters, sha256_hex
    from peer.network.buckets import DHTBucketStore
    from peer.network.swarm import NetworkConfig
    from peer.network.swarm import join as join_swarm
    from peer.roles.learner.intake import carries_signal
    from peer.roles.learner.peer import LearnerConfig, LearnerPeer, batch_tensors, learn_step

    class RecordingLearner(LearnerPeer):
        """The learner, unchanged, keeping each update's groups (and the version it was made at) for the replay."""

        updates: list = []
        ends: list = []  # when each update returned
        trained: list = []  # the learner's training CPU seconds then

        def _update(self, chosen) -> None:
            self.updates.append((self.session.version, list(chosen)))
            super()._update(chosen)
            self.ends.append(time.perf_counter())
            self.trained.append(self.train_cpu)

    run_id = "bench-learner"
    from peer.demo.swarm import LOOPBACK, Child

    children: list[Child] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        learner = None
        try:
            info_file = root / "info.json"
            host_argv = ["host", "--run-id", run_id, "--tau-max", str(tau_max), "--cache-dir", str(root / "host")]
            children.append(Child("host", [*host_argv, "--info-file", str(info_file), *LOOPBACK], root))
            wait_until(info_file.exists, "the host's join details", 120, processes(children), interval=0.5)
            info = json.loads(info_file.read_text())
            peers = [a for m in info["initial_peers"] for a in ("--initial-peers", m)]
            join = ["join", "--run-id", run_id, "--coordinator", info["coordinator"], *peers, *LOOPBACK]
            join += ["--cache-dir", str(root / "rollout"), "--device", "cpu", "--batch-size", "16"]
            join += ["--max-inflight", str(groups), "--max-groups", str(groups)]
            children.append(Child("rollout", join, root))
            fill_start = time.perf_counter()
            rollout = children[-1]
            wait_until(lambda: not rollout.alive, f"the rollout peer publishing {groups} groups", 900, interval=0.5)
            if rollout.process.returncode != 0:
                raise RuntimeError(f"the rollout peer failed: {rollout.tail(20)}")
            fill_seconds = time.perf_counter() - fill_start
            counter = join_swarm(NetworkConfig.loopback(info["initial_peers"]), run_id)
            try:  # the host's DHT node holds the (inline) entries now that their producer has left
                store = DHTBucketStore(counter)
                wait_until(
                    lambda: store.count(0, 0) >= groups, f"{groups} groups in the bucket", 60, processes(children[:1])
                )
                fetched = [f for f in store.fetch(0, 0) if f.group is not None]
                read, producers = [f.group for f in fetched], {f.owner for f in fetched}
            finally:
                counter.shutdown()
            # a group whose rewards are all equal never takes an update's slot: the learner makes a version per 16
            # groups with signal, and would wait for more (none come) if asked for more versions than they fill
            with_signal = sum(carries_signal(g.rewards) for g in read)
            versions = min(args.versions, with_signal // 16)
            if versions < 1:
                raise RuntimeError(
                    f"{with_signal} of {len(read)} groups carry signal, not a version's: use more --groups"
                )
            config = LearnerConfig(
                run_id=run_id,
                network=NetworkConfig.loopback(info["initial_peers"]),
                coordinator=info["coordinator"],
                learner_credential=info["learner_credential"],
                cache_dir=root / "learner",
                device="cpu",
                max_versions=versions,
            )
            learner = RecordingLearner(config).start()  # its fetcher starts reading the buckets now
            from peer.roles.learner.intake import PROBATION

            for owner in producers:  # a run's steady state: the producer is proven (probation is for newcomers,
                learner.intake.prove(owner, PROBATION)  # and its groups pass it in the run loop, after this)
            s = learner.session
            params = lora_parameters(s.model)
            v0 = [p.detach().clone() for p in params]
            v0_sha = s.sha

            started = time.perf_counter()
            summary = learner.run()
            learner_seconds = time.perf_counter() - started
            learner_sha = s.sha

            bare = []
            for _ in range(args.bare_rounds):
                with torch.no_grad():
                    for p, v in zip(params, v0, strict=True):
                        p.copy_(v)
                optimizer = torch.optim.AdamW(params, lr=config.lr)
                t0, ends = time.perf_counter(), []
                for version, chosen in learner.updates:
                    batch = batch_tensors(chosen, version, s.spec, learner.pad_id(), s.device)
                    learn_step(s.model, batch, s.spec, optimizer, config.max_grad_norm)
                    ends.append(time.perf_counter())
                bare.append((ends[-1] - t0, ends[-1] - ends[0]))
            same_adapter = sha256_hex(adapter_to_bytes(s.model)) == learner_sha
        finally:
            if learner is not None:
                learner.close()
            for c in children:
                c.stop()

    used = sum(len(chosen) for _, chosen in learner.updates)
    after_first = used - len(learner.updates[0][1])  # the steady state: from the end of the first update on
    bare_rates = [used / b[0] for b in bare]
    bare_steady = [after_first / b[1] for b in bare]
    learner_rate = summary.groups_accepted / learner_seconds
    learner_steady = after_first / (learner.ends[-1] - learner.ends[0])
    # training CPU seconds per wall second from the end of the first update on: the pipeline's busy fraction once
    # groups are there (the whole run's also counts the wait for the first read of the buckets)
    busy_steady = (learner.trained[-1] - learner.trained[0]) / (learner.ends[-1] - learner.ends[0])
    result = {
        "versions": summary.versions_made,
        "versions_asked": args.versions,
        "groups_in_bucket": groups,
        "groups_with_signal": with_signal,
        "groups_used": used,
        "groups_accepted": summary.groups_accepted,
        "logprob_checks": summary.logprob_checks,
        "learner_seconds": round(learner_seconds, 3),
        "learner_groups_per_second": round(learner_rate, 2),
        "learner_step_seconds_mean": summary.step_seconds_mean,
        "learner_busy_fraction": summary.busy_fraction,
        "learner_busy_fraction_steady": round(busy_steady, 3),
        "learner_phase_seconds": summary.phase_seconds,
        "learner_steady_groups_per_second": round(learner_steady, 2),
        "bare_seconds": [round(b[0], 3) for b in bare],
        "bare_groups_per_second": [round(r, 2) for r in bare_rates],
        "bare_steady_groups_per_second": [round(r, 2) for r in bare_steady],
        "ratio": round(learner_rate / statistics.median(bare_rates), 3),
        "ratio_steady": round(learner_steady / statistics.median(bare_steady), 3),
        "same_adapter": same_adapter,
        "v0_sha256": v0_sha,
        "bucket_fill_seconds": round(fill_seconds, 1),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    print(
        f"learner: {summary.versions_made} versions, {summary.groups_accepted} groups in {learner_seconds:.2f} s"
        f" = {learner_rate:.1f} groups/s ({summary.logprob_checks} log-prob checks); bare loss+step on the same"
        f" batches: {', '.join(f'{r:.1f}' for r in bare_rates)} groups/s; ratio {result['ratio']:.3f}"
        f" (target >= 0.9); from the end of the first update on: {learner_steady:.1f} against"
        f" {statistics.median(bare_steady):.1f} groups/s, ratio {result['ratio_steady']:.3f};"
        f" same final adapter: {same_adapter}; the learner's busy fraction {summary.busy_fraction}"
        f" ({busy_steady:.3f} from the end of the first update on);"
        f" {args.threads} thread(s)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
