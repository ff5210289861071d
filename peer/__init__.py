"""hivegrpo: a volunteer-computing, peer-to-peer client for asynchronous GRPO fine-tuning with LoRA.

The ``peer`` package holds everything a swarm member runs (model loading, tasks, GRPO math, the rollout and
learner loops); ``coordinator`` holds hosting. ``peer`` never imports ``coordinator``.
"""

__version__ = "0.1.0"
