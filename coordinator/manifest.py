"""Building a run manifest: the base model's files and hashes, the task, the hyperparameters, adapter v0.

What every peer of the run will read back with :func:`peer.run.spec.run_spec` — built here from the same configs
and checked by doing exactly that before it is ever published.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from peer.errors import UserError
from peer.grpo.config import LossConfig, PromptConfig, SamplingConfig, StalenessConfig
from peer.model.config import LoRAConfig
from peer.protocol import ManifestRecord, ModelSpec, TaskSpec
from peer.protocol.limits import MAX_JSON_CHARS
from peer.run.basemodel import model_files
from peer.run.spec import DEFAULT_GROUPS_PER_VERSION, grpo_json, run_spec
from peer.tasks import get_task


@dataclass(frozen=True)
class RunSettings:
    """What the host chooses for a run (the command line's options)."""

    run_id: str
    model: str = "bundled"
    revision: str | None = None
    quantization: str = "nf4"
    task: str = "addition"
    task_config: dict = field(default_factory=dict)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    groups_per_version: int = DEFAULT_GROUPS_PER_VERSION
    seed: int = 0
    access: str = "public"


def model_folder(name: str, revision: str | None) -> Path:
    """The local folder of the base model: bundled, a directory, or a hub snapshot (downloaded once)."""
    from peer.model.loading import resolve_source

    source = resolve_source(name)
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    from peer.model.loading import ModelLoadError

    try:
        return Path(
            snapshot_download(name, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
        )
    except Exception as e:  # the hub raises many types
        raise ModelLoadError(
            f"could not download {name!r} from the model hub ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "check the id and the network, or pass a local model directory"
        ) from e


def published_name(model: str, folder: Path) -> str:
    """The model's name in the manifest: ``bundled`` or a hub id as given; a local folder by its base name only
    (a path on the host's disk means nothing to other peers, and they must fetch its files over P2P)."""
    from peer.model.loading import BUNDLED

    if model == BUNDLED or not Path(model).expanduser().exists():
        return model
    return Path(folder).resolve().name


class ManifestTooLarge(UserError, ValueError):
    """The run's settings do not fit in the manifest's size limits."""


def check_prompt(settings: RunSettings, folder: Path) -> None:
    """Refuse a chat template the model's tokenizer does not have, before anything is published."""
    if settings.prompt.chat_template == "none":
        return
    from peer.model.loading import load_tokenizer
    from peer.model.prompts import check_prompt_config

    check_prompt_config(load_tokenizer(str(folder)), settings.prompt)


def check_settings(settings: RunSettings) -> tuple[dict, str]:
    """The task's spec and the manifest's ``grpo_json`` for ``settings``, once what needs no model is checked: the
    task resolves with its config (:class:`~peer.tasks.TaskError` else) and both fit in the manifest
    (:class:`ManifestTooLarge` else). ``hivegrpo host`` calls it before it loads anything."""
    spec = get_task(settings.task, settings.task_config).spec()
    config_chars = len(json.dumps(spec["config"], sort_keys=True))
    if config_chars > MAX_JSON_CHARS:
        raise ManifestTooLarge(
            f"the task's config takes {config_chars} characters of JSON, the manifest allows {MAX_JSON_CHARS}; "
            "shorten --task-config"
        )
    grpo = grpo_json(
        settings.sampling, settings.loss, settings.staleness, settings.groups_per_version, settings.prompt
    )
    if len(grpo) > MAX_JSON_CHARS:
        raise ManifestTooLarge(
            f"the run's GRPO settings take {len(grpo)} characters of JSON, the manifest allows {MAX_JSON_CHARS}; "
            "shorten --system-prompt (or the --stop strings)"
        )
    return spec, grpo


def build_manifest(
    settings: RunSettings, folder: Path, adapter0_sha256: str, coordinator_peer_id: str
) -> ManifestRecord:
    """The manifest of a run on the model in ``folder``; checked by parsing it back as a peer would."""
    spec, grpo = check_settings(settings)
    check_prompt(settings, folder)
    manifest = ManifestRecord(
        run_id=settings.run_id,
        created=time.time(),
        access=settings.access,
        seed=settings.seed,
        model=ModelSpec(
            name=published_name(settings.model, folder),
            revision=settings.revision,
            quantization=settings.quantization,
            files=model_files(folder),
        ),
        task=TaskSpec(name=spec["name"], config_json=json.dumps(spec["config"], sort_keys=True)),
        grpo_json=grpo,
        lora_json=json.dumps(settings.lora.to_dict(), sort_keys=True),
        adapter0_sha256=adapter0_sha256,
        coordinator=coordinator_peer_id,
    )
    # The same checks every peer will make; the host typed its task itself, so its plug-in module (if any) is allowed.
    own = frozenset({spec["name"].partition(":")[0]}) if ":" in spec["name"] else frozenset()
    run_spec(manifest, b"", allowed_modules=own)
    return manifest
