"""Model helpers the tests share."""

import torch

from peer.model.adapter import lora_parameters


def random_lora(model, seed: int = 1, scale: float = 0.05) -> None:
    """Every LoRA tensor of ``model`` to seeded normal values times ``scale`` (a fresh adapter's B is all zero, so
    it would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
