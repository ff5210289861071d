"""Models: the bundled tiny base, loading a (quantized) base, LoRA adapters, sampling.

Submodules import torch/transformers; import them lazily from command-line code.
"""
