"""A sampler's LoRA update added into its base weights, once per adapter version (rollout peers, float32 bases).

A LoRA'd linear layer computes ``x W0ᵀ + s (x Aᵀ) Bᵀ``: three matrix products, a scale and an add at every forward.
A rollout peer only samples, and samples many tokens with each adapter version, so it can hold ``W0 + s B A`` in
the base layer's weight and compute one product (peft's own forward does exactly that for a *merged* layer). On
the bundled model that is about a fifth of the sampling time; on a real model the update costs ``d·d'·r``
multiply-adds once per version, against ``r (d + d')`` per token for every token of every batch.

Every version's weights are ``W0 + its update``, computed from a kept copy of ``W0``: never the previous version's
weights plus a difference, whose rounding would add up over thousands of swaps. The copy is the price (a float32
copy of every LoRA'd layer's weight), so it is made only where it fits, by the same rule as unpacking a 4-bit base
(:func:`peer.model.memory.room_for`); otherwise the peer samples through the LoRA layers as before.

Only float32 weights on the CPU: in bfloat16 or float16, ``W0 + ΔW`` rounds most of a small update away (and the
room for the copy is measured in RAM). The LoRA parameters stay what they are (the adapter's bytes, its hash, a
swap's check), so nothing outside the forward changes; the log-probs differ from the unmerged forward's by float32
rounding (up to 5e-5 nats measured), far inside what a learner's spot check tolerates between honest peers
(:class:`peer.roles.learner.verify.LogprobCheck`).
"""

from __future__ import annotations

import torch

from peer.log import get_logger
from peer.model.memory import mib, room_for

logger = get_logger(__name__)

BUFFER = "hivegrpo_w0"  # the kept base weight, a non-persistent buffer of each merged layer (so memory counts it)


def _mergeable(model) -> tuple[list, str | None]:
    """The LoRA layers to merge, or why the model cannot be merged."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        return [], "no LoRA layers"
    for layer in layers:
        base = layer.get_base_layer()
        if type(base) is not torch.nn.Linear:
            return [], f"its base layers are {type(base).__name__}, not plain float32 Linear (a 4-bit or 8-bit base)"
        if base.weight.dtype != torch.float32:
            return [], f"its base weights are {base.weight.dtype}: adding the update there would round it away"
        if base.weight.device.type != "cpu":  # the copy's room is measured in RAM (a GPU's would be its own)
            return [], f"its base weights are on {base.weight.device.type}, not the CPU"
        if layer.lora_variant or getattr(layer, "fan_in_fan_out", False) or len(layer.active_adapters) != 1:
            return [], "its LoRA layers are not plain single-adapter LoRA"
    return layers, None


class MergedLoRA:
    """The model's LoRA update held in its base weights; :meth:`refresh` after every change of the LoRA tensors."""

    def __init__(self, model, layers: list) -> None:
        self.model, self.layers = model, layers
        self.refreshes = 0
        with torch.no_grad():
            for layer in layers:
                layer.register_buffer(BUFFER, layer.get_base_layer().weight.detach().clone(), persistent=False)
        self.refresh()

    @classmethod
    def of(cls, model, max_memory: int | None = None) -> MergedLoRA | None:
        """Merge ``model``'s LoRA into its base weights if it can be (float32, plain LoRA) and the copy of the base
        weights fits (``max_memory``: a rollout peer's ``--max-memory``); else None, with the reason logged."""
        layers, why = _mergeable(model)
        if why is None:
            need = sum(layer.get_base_layer().weight.numel() * 4 for layer in layers)
            if (short := room_for(model, need, max_memory)) is not None:
                why = f"keeping the base weights' copy ({mib(need)}) does not fit: {short}"
        if why is not None:
            logger.info("sampling through the LoRA layers (not merged into the base weights): %s", why)
            return None
        return cls(model, layers)

    def refresh(self) -> None:
        """Every merged layer's weight := its kept base weight + the LoRA update the model holds now."""
        with torch.no_grad():
            for layer in self.layers:
                name = layer.active_adapters[0]
                torch.add(getattr(layer, BUFFER), layer.get_delta_weight(name), out=layer.get_base_layer().weight)
                layer.merged_adapters = [name]  # peft's forward: a merged layer computes its base layer only
        self.refreshes += 1

    def unmerge(self) -> None:
        """Back to sampling through the LoRA layers: every base weight := its kept copy (:meth:`refresh` merges
        again)."""
        with torch.no_grad():
            for layer in self.layers:
                layer.get_base_layer().weight.copy_(getattr(layer, BUFFER))
                layer.merged_adapters = []


__all__ = ["BUFFER", "MergedLoRA"]
