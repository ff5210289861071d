"""Tasks: deterministic problem generators with pure rewards, the same on every peer.

A task is named by a spec ``{"name": ..., "config": {...}}``; :func:`get_task` resolves built-in tasks
(``addition``), reasoning-gym datasets (``chain_sum``, ...) and plug-ins (``module:attribute``). Peers exchange only
specs and ``(seed, index)`` pairs; :func:`derive_seed` makes every random draw reproducible across machines.
Nothing here imports torch, and reasoning-gym is imported only when one of its datasets is asked for.
"""

from peer.tasks.base import Example, Task
from peer.tasks.errors import PluginNotAllowed, TaskError
from peer.tasks.registry import builtin_task_names, get_task
from peer.tasks.seeds import derive_seed

__all__ = ["Example", "PluginNotAllowed", "Task", "TaskError", "builtin_task_names", "derive_seed", "get_task"]
