"""A run as every peer sees it: the manifest read from the swarm, turned into typed configs, and the prompt rule.

The coordinator publishes one :class:`~peer.protocol.ManifestRecord` under ``{run}_manifest``, in the subkey of
its own signing key. :func:`read_manifest` finds it (checking the coordinator's key *fingerprint* when the user
passed one with ``--coordinator``) and :func:`run_spec` turns it into a :class:`RunSpec`: the task, the GRPO
configs, the LoRA shape, the learners' batch. Nothing in it is trusted to be sane before this module checked it:
an unknown task or a bad config ends in a :class:`ManifestError` that says so.

A manifest never runs code by itself: its task is built from the built-in tasks and reasoning-gym datasets, or
from a plug-in (``module:attribute``) only when this peer's user allowed that module (``--allow-task``,
``allowed_modules``) — importing a module runs it, and anyone on a public swarm can publish a manifest.

Prompts are never chosen by a peer. Group ``seq`` of the peer whose signing key is ``owner`` samples the example
``task.example(prompt_seed(run_seed, owner), seq)``: a learner regenerates the prompt and its reference answer from
the group's subkey alone, so a peer cannot pick easy prompts or answer a question it was not given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from peer.errors import UserError
from peer.grpo.config import LossConfig, PromptConfig, SamplingConfig, StalenessConfig
from peer.model.config import LoRAConfig
from peer.protocol import (
    BUCKET_RING,
    MAX_COMPLETION_TOKENS,
    MAX_GROUP_SIZE,
    ManifestRecord,
    RecordError,
    from_dht_value,
    key_fingerprint,
    manifest_key,
    parse_owner_subkey,
)
from peer.tasks import PluginNotAllowed, Task, TaskError, derive_seed, get_task

DEFAULT_GROUPS_PER_VERSION = 16


class ManifestError(UserError, ValueError):
    """The run manifest is missing, ambiguous, or names something this peer cannot use."""


def prompt_seed(run_seed: int, owner: bytes) -> int:
    """The task seed of every group a peer with signing key ``owner`` publishes in a run seeded ``run_seed``."""
    return derive_seed(run_seed, "prompts", owner)


def sampling_seed(run_seed: int, owner: bytes, seq: int) -> int:
    """Seed of the sampler for the batch that starts at group ``seq`` (reproducibility, not verification)."""
    return derive_seed(run_seed, "sampling", owner, seq)


@dataclass(frozen=True)
class RunSpec:
    """Everything a peer needs from the manifest, parsed and checked."""

    manifest: ManifestRecord
    coordinator_key: bytes
    task: Task
    sampling: SamplingConfig
    loss: LossConfig
    staleness: StalenessConfig
    lora: LoRAConfig
    groups_per_version: int
    prompt: PromptConfig = PromptConfig()  # how questions become prompt tokens, which strings end a completion

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    @property
    def seed(self) -> int:
        return self.manifest.seed

    def example(self, owner: bytes, seq: int):
        """The example group ``seq`` of ``owner`` must answer."""
        return self.task.example(prompt_seed(self.seed, owner), seq)


def grpo_json(
    sampling: SamplingConfig,
    loss: LossConfig,
    staleness: StalenessConfig,
    groups_per_version: int = DEFAULT_GROUPS_PER_VERSION,
    prompt: PromptConfig = PromptConfig(),
) -> str:
    """The manifest's ``grpo_json`` for these configs (what :func:`run_spec` reads back).

    The ``prompt`` section is written only when it differs from the default (raw questions, no stop strings), so a
    run without a chat template publishes the same document as before the section existed.
    """
    data = {
        "sampling": sampling.to_dict(),
        "loss": loss.to_dict(),
        "staleness": staleness.to_dict(),
        "groups_per_version": groups_per_version,
    }
    if prompt != PromptConfig():
        data["prompt"] = prompt.to_dict()
    return json.dumps(data, sort_keys=True)


def run_spec(
    manifest: ManifestRecord, coordinator_key: bytes, *, allowed_modules: frozenset[str] = frozenset()
) -> RunSpec:
    """Parse the manifest's task and configs; :class:`ManifestError` naming the bad part.

    :param allowed_modules: the plug-in task modules this peer's user allowed (``--allow-task``); a manifest naming
      any other plug-in is refused before its module is imported.
    """
    try:
        task = get_task(manifest.task.name, manifest.task.config(), allowed_modules=allowed_modules)
    except PluginNotAllowed as e:
        raise ManifestError(
            f"the run manifest names the plug-in task {e.ref!r}, whose module {e.module!r} this peer has not "
            "allowed: a manifest never runs code by itself; if you trust the host and have that module installed, "
            f"pass --allow-task {e.module}"
        ) from e
    except TaskError as e:
        raise ManifestError(
            f"the run manifest names a task this peer cannot build ({e}) — install the package that provides it "
            "or ask the run's host which hivegrpo version to use"
        ) from e
    grpo = manifest.grpo()
    try:
        known = {"sampling", "loss", "staleness", "groups_per_version", "prompt"}
        unknown = sorted(set(grpo) - known)
        if unknown:
            raise ValueError(f"unknown GRPO section(s) {unknown}")
        sampling = SamplingConfig.from_dict(grpo.get("sampling", {}))
        loss = LossConfig.from_dict(grpo.get("loss", {}))
        staleness = StalenessConfig.from_dict(grpo.get("staleness", {}))
        prompt = PromptConfig.from_dict(grpo.get("prompt", {}))
        lora = LoRAConfig.from_dict(manifest.lora())
        groups = grpo.get("groups_per_version", DEFAULT_GROUPS_PER_VERSION)
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= 4096:
            raise ValueError(f"groups_per_version must be an int in [1, 4096], got {groups!r}")
        if sampling.group_size > MAX_GROUP_SIZE or sampling.max_new_tokens > MAX_COMPLETION_TOKENS:
            raise ValueError(
                f"group_size {sampling.group_size} / max_new_tokens {sampling.max_new_tokens} exceed the protocol's "
                f"{MAX_GROUP_SIZE} / {MAX_COMPLETION_TOKENS}"
            )
        if staleness.tau_max + 2 >= BUCKET_RING:
            raise ValueError(f"tau_max {staleness.tau_max} needs tau_max + 2 < {BUCKET_RING} (the bucket ring)")
    except (ValueError, TypeError) as e:
        raise ManifestError(
            f"the run manifest's hyperparameters are not usable by this peer ({e}); upgrade hivegrpo to the "
            "host's version"
        ) from e
    return RunSpec(manifest, coordinator_key, task, sampling, loss, staleness, lora, groups, prompt)


def read_manifest(swarm, coordinator: str | None = None) -> tuple[ManifestRecord, bytes]:
    """The run's manifest and the key that signed it.

    :param coordinator: the fingerprint (:func:`key_fingerprint`) of the coordinator's key, as ``hivegrpo host``
      prints it; without it the manifest is taken only when exactly one signer published one.
    """
    found: list[tuple[ManifestRecord, bytes]] = []
    refused: list[str] = []
    for subkey, item in swarm.get_dict(manifest_key(swarm.run_id)).items():
        try:
            owner = parse_owner_subkey(subkey)
            record = from_dht_value(ManifestRecord, item.value)
        except (RecordError, ValueError) as e:
            refused.append(str(e))
            continue
        if record.run_id != swarm.run_id:
            refused.append(f"a manifest for run {record.run_id!r}")
            continue
        if coordinator is None or key_fingerprint(owner) == coordinator:
            found.append((record, owner))
    if not found:
        detail = f" ({len(refused)} unusable: {refused[0]})" if refused else ""
        who = f" signed by coordinator {coordinator}" if coordinator else ""
        raise ManifestError(
            f"no manifest for run {swarm.run_id!r}{who} in the swarm{detail}: check --run-id (and --coordinator) "
            "against what `hivegrpo host` printed, and that the host is running"
        )
    if len(found) > 1:
        prints = ", ".join(sorted(key_fingerprint(owner) for _, owner in found))
        raise ManifestError(
            f"{len(found)} peers publish a manifest for run {swarm.run_id!r} (coordinators {prints}): pass "
            "--coordinator with the fingerprint `hivegrpo host` printed to choose the real one"
        )
    return found[0]


def manifest_summary(spec: RunSpec) -> dict[str, Any]:
    m = spec.manifest
    return {
        "run_id": m.run_id,
        "model": m.model.name,
        "quantization": m.model.quantization,
        "task": spec.task.spec(),
        "group_size": spec.sampling.group_size,
        "coordinator": key_fingerprint(spec.coordinator_key),
    }
