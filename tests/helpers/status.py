"""A run as ``hivegrpo status`` reads it, for tests of its summary: the time it is, and the host's manifest."""

import json

from peer.protocol.records import ManifestRecord, ModelFile, ModelSpec, TaskSpec
from tests.helpers.records import make_manifest

NOW = 1_000_000.0
"""The time every status summary of the tests is made at (heartbeats and records are dated before it)."""


def status_manifest(run_id: str = "run-s", group_size: int = 8) -> ManifestRecord:
    """The manifest of run ``run_id``, published by the host ``QmHost`` 200 s before ``NOW``: the run status
    summarizes (its groups of ``group_size`` turn a rollout peer's completions/s into groups/s)."""
    grpo = {"sampling": {"group_size": group_size}, "staleness": {"tau_max": 4}, "groups_per_version": 16}
    return make_manifest(
        run_id=run_id,
        created=NOW - 200,
        access="public",
        model=ModelSpec(
            name="bundled", revision=None, quantization="nf4", files=[ModelFile(path="m", sha256="d" * 64, size=1)]
        ),
        task=TaskSpec(name="addition", config_json="{}"),
        grpo_json=json.dumps(grpo),
        lora_json="{}",
        adapter0_sha256="a" * 64,
        coordinator="QmHost",
    )
