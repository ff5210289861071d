"""hivegrpo: a volunteer-computing, peer-to-peer client for asynchronous GRPO fine-tuning with LoRA.

The ``peer`` package holds everything a swarm member runs (model loading, tasks, GRPO math, the rollout and
learner loops); ``coordinator`` holds hosting. ``peer`` never imports ``coordinator``.
"""

import logging

__version__ = "0.1.0"


class _NoOptionalKernel(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning, logged at its
    import on CPUs with AVX512-BF16: that kernel serves the 4-bit inference repacking this project turns off on
    every layer (``peer.model.loading``), and it would come from a hub at run time. Installed here, before anything
    imports bitsandbytes (peft does, at its own import), so no command starts with a line that says something failed.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoOptionalKernel())
