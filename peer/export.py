"""``hivegrpo export``: a run's adapter out of the tool, as a PEFT folder or merged into a full model.

Where the adapter comes from:

- ``--adapter PATH``: any adapter :func:`peer.model.peft_folder.read_adapter` takes (a PEFT folder, a learner's
  checkpoint folder, a hivegrpo blob file);
- the swarm (``--initial-peers``, ``--run-id``, best with ``--coordinator``): the newest version an *admitted*
  learner announced, or ``--version N`` when N is that version or one of the ancestors its announcement lists
  (the last 16). The bytes come over P2P from whoever still holds them and must hash to the announced sha256; the
  tensors must be finite floats of the run's LoRA shape. Nothing a stranger announces is taken.

What is written to ``--out``:

- by default the PEFT folder (``adapter_config.json`` naming the run's base model, ``adapter_model.safetensors``);
- with ``--merge`` a full model folder: the base loaded as the adapter was trained on it (the run's quantization),
  de-quantized to float32, the LoRA update added into its weights (peft's ``merge_and_unload``), saved with its
  tokenizer and generation config. ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it with transformers alone.
  Merging into the de-quantized weights keeps the function the swarm trained (LoRA learned its update against those
  weights, not the original full-precision ones).

``--push-to-hub REPO`` uploads the folder with ``huggingface_hub`` (a token from ``HF_TOKEN`` or ``hf auth login``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from peer.errors import UserError
from peer.log import get_logger
from peer.model.adapter import AdapterError, attach_lora, load_adapter_bytes, sha256_hex
from peer.model.config import LoRAConfig, ModelConfig
from peer.model.peft_folder import base_model_name, read_adapter, write_peft_folder

logger = get_logger(__name__)


@dataclass(frozen=True)
class ExportConfig:
    out: Path
    adapter: Path | None = None  # a local adapter; None: the swarm's
    run_id: str | None = None
    network: object = None  # NetworkConfig of the swarm to fetch from
    coordinator: str | None = None
    version: int | None = None  # None: the newest
    model: str | None = None  # base model; None: the run's (swarm) or the one the adapter folder names
    quantization: str | None = None  # how the base was held while the adapter trained; None: the run's (or nf4)
    merge: bool = False
    push_to_hub: str | None = None
    private: bool = False
    cache_dir: Path = Path("~/.cache/hivegrpo").expanduser()


@dataclass
class Source:
    """An adapter to export and what it was trained on."""

    blob: bytes
    lora: LoRAConfig
    base_model: str | None  # a hub id or a model folder; None: unknown (a bare blob file)
    quantization: str
    version: int | None = None
    folder: Path | None = None  # the base model's files, when the swarm provided them


def export(config: ExportConfig) -> dict:
    """Write the adapter (or the merged model) to ``config.out``; the dict ``hivegrpo export --json`` prints."""
    start = time.monotonic()
    source = _from_file(config) if config.adapter is not None else _from_swarm(config)
    out = Path(config.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder: pass a new --out folder")
    if config.merge:
        _merge(source, out)
    else:
        write_peft_folder(out, source.blob, source.base_model or "")
    result = {
        "out": str(out),
        "merged": config.merge,
        "adapter_sha256": sha256_hex(source.blob),
        "version": source.version,
        "base_model": source.base_model,
        "quantization": source.quantization if config.merge else None,
        "seconds": round(time.monotonic() - start, 2),
    }
    if config.push_to_hub:
        result["pushed_to"] = push_to_hub(out, config.push_to_hub, private=config.private)
    return result


def _from_file(config: ExportConfig) -> Source:
    blob, lora = read_adapter(config.adapter)
    base = config.model or _named_base(config.adapter)
    if base is None and config.merge:
        raise UserError(f"{config.adapter} does not name its base model: pass --model (the model it was trained on)")
    return Source(blob, lora, base_model_name(base) if base else None, config.quantization or "nf4")


def _named_base(path: Path) -> str | None:
    """The base model a PEFT folder's ``adapter_config.json`` names, if any."""
    path = Path(path).expanduser()
    config = (path if path.is_dir() else path.parent) / "adapter_config.json"
    try:
        return json.loads(config.read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError, AttributeError):
        return None


EXPORT_ADAPTER_LIMIT = 2 * 1024**3  # bytes: the largest adapter export takes when the run's v0 size is not known


def _from_swarm(config: ExportConfig) -> Source:
    from peer.network.admission import Admitted
    from peer.network.blobs import BlobCache, BlobService, BlobUnavailable
    from peer.network.heartbeat import blob_providers
    from peer.network.swarm import join
    from peer.run.adapters import announcements
    from peer.run.basemodel import fetch_from, resolve_base
    from peer.run.spec import read_manifest

    network = dataclasses.replace(config.network, client_mode=True)  # it serves nobody
    with join(network, config.run_id) as swarm:
        blobs = BlobService(swarm.dht, BlobCache(config.cache_dir / "blobs"), access=swarm.access)
        try:
            manifest, coordinator_key = read_manifest(swarm, config.coordinator)
            try:
                lora = LoRAConfig.from_dict(manifest.lora())  # the task is not needed: no plug-in is imported
            except (ValueError, TypeError) as e:
                raise UserError(f"the run's manifest has a LoRA shape this hivegrpo cannot read ({e})") from None
            admitted = Admitted(swarm, coordinator_key, manifest.adapter0_sha256)
            records = sized_announcements(announcements(swarm, admitted), admitted, coordinator_key)
            version, sha, size, providers = _choose(records, config.version)
            # the coordinator seeds the model, admitted learners keep older adapters: no heartbeat comes before them
            providers_of = partial(blob_providers, swarm, [manifest.coordinator, *sorted(admitted.peer_ids())])
            try:
                blob = _fetch(blobs, sha, size, providers, providers_of)
            except BlobUnavailable as e:
                raise UserError(f"no peer of run {config.run_id!r} delivered adapter v{version} ({e})") from None
            _check_blob(blob, sha, lora, version)
            folder = None
            if config.merge and config.model is None:
                folder = resolve_base(
                    manifest.model, blobs.cache, config.cache_dir / "models", fetch_from(blobs, providers_of)
                )
        finally:
            blobs.close()
    logger.info("adapter v%d (%s…) of run %s fetched and checked", version, sha[:12], config.run_id)
    base = config.model or manifest.model.name
    quantization = config.quantization or manifest.model.quantization
    return Source(blob, lora, base_model_name(base), quantization, version, folder)


def sized_announcements(records, admitted, coordinator_key: bytes) -> list:
    """``records`` (admitted announcements) whose size is the run's: the coordinator's v0 announcement says it (the
    LoRA shape fixes every version's); without it, at most ``EXPORT_ADAPTER_LIMIT``. A stolen credential then cannot
    make an export fetch and read gigabytes."""
    v0 = next((r for signer, r in records if signer == coordinator_key and r.version == 0), None)
    admitted.adapter_size = 0 if v0 is None else v0.size
    return [
        (s, r) for s, r in records if admitted.admits_announcement(s, r) is None and r.size <= EXPORT_ADAPTER_LIMIT
    ]


def _choose(records, version: int | None) -> tuple[int, str, int, tuple[str, ...]]:
    """(version, sha256, size, providers) of the newest admitted version, or of ``version`` when an admitted
    announcement is of it or lists it among its ancestors."""
    from peer.protocol.limits import MAX_ANCESTORS
    from peer.run.adapters import newest_announcement

    newest = newest_announcement(records)
    if newest is None:
        raise UserError("no admitted learner announces an adapter in this run yet: wait for its first version")
    if version is None or version == newest.version:
        return newest.version, newest.sha256, newest.size, newest.providers
    for _, record in sorted(records, key=lambda kr: kr[1].version):
        if record.version == version:
            return version, record.sha256, record.size, tuple(record.providers)
        back = record.version - version - 1
        if 0 <= back < len(record.ancestors):
            return version, record.ancestors[back], record.size, tuple(record.providers)
    raise UserError(
        f"adapter v{version} is not announced any more (the newest is v{newest.version}, and announcements list "
        f"only their {MAX_ANCESTORS} latest ancestors): export a newer version, or a learner's checkpoint folder"
    )


def _fetch(blobs, sha: str, size: int, announced, others) -> bytes:
    from peer.network.blobs.fetch import DEFAULT_TIMEOUT
    from peer.run.adapters import fetch_adapter

    return fetch_adapter(blobs, sha, size, announced, others, DEFAULT_TIMEOUT)


def _check_blob(blob: bytes, sha: str, lora: LoRAConfig, version: int) -> None:
    """The announced bytes (sha256), whole finite float tensors, of the run's LoRA shape."""
    import torch
    from safetensors.torch import load as st_load

    from peer.model.adapter import blob_lora_config

    if sha256_hex(blob) != sha:
        raise AdapterError(f"adapter v{version}'s bytes do not hash to the announced {sha[:12]}…; export again")
    own = blob_lora_config(blob)
    if (own.r, own.alpha, set(own.target_modules)) != (lora.r, lora.alpha, set(lora.target_modules)):
        raise AdapterError(f"adapter v{version} is not of the run's LoRA shape; it cannot be exported")
    for key, t in st_load(blob).items():
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise AdapterError(f"adapter v{version}'s tensor {key} is not finite floats; it cannot be exported")


def _merge(source: Source, out: Path) -> None:
    """Base as trained on, de-quantized; LoRA merged in; saved with tokenizer and generation config."""
    from peer.model.loading import load_base

    name = str(source.folder) if source.folder is not None else source.base_model
    base = load_base(
        ModelConfig(name=name, quantization=source.quantization, device="cpu", dtype="float32"), unpack=False
    )
    model = base.model
    if source.quantization != "none":  # float32 weights as the swarm saw them (bitsandbytes' own de-quantization;
        model = model.dequantize()  # transformers drops the config's quantization_config with it)
    peft_model = attach_lora(model, source.lora)
    load_adapter_bytes(peft_model, source.blob)
    merged = peft_model.merge_and_unload()
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    merged.save_pretrained(tmp, safe_serialization=True)
    base.tokenizer.save_pretrained(tmp)
    generation = Path(base.source) / "generation_config.json"
    if generation.is_file() and not (tmp / "generation_config.json").exists():
        shutil.copy(generation, tmp / "generation_config.json")
    if out.exists():
        out.rmdir()  # empty (checked before)
    tmp.rename(out)


def push_to_hub(folder: Path, repo: str, *, private: bool = False) -> str:
    """Upload ``folder`` to the hub repository ``repo``; UserError without a token or a network."""
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise UserError(
            f"--push-to-hub {repo}: no Hugging Face token on this machine; run `hf auth login` or set HF_TOKEN "
            f"(the export itself is in {folder})"
        )
    api = HfApi(token=token)
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="Upload with hivegrpo export")
    except Exception as e:  # the network boundary: HTTP, DNS, permissions
        raise UserError(
            f"--push-to-hub {repo} failed ({type(e).__name__}: {str(e)[:200]}); check the network, the token's "
            f"write access and the repository name (the export itself is in {folder})"
        ) from None
    return f"https://huggingface.co/{repo}"


__all__ = ["ExportConfig", "export", "push_to_hub"]
