"""Resolving a task name and config into a :class:`~peer.tasks.Task`.

:func:`get_task` tries, in order: the built-in names (:func:`builtin_task_names`), a ``module:attribute`` plug-in
reference when the name contains ``":"`` (:mod:`peer.tasks.plugin`), then reasoning-gym dataset names
(:mod:`peer.tasks.gym`, imported only on that path). The config is checked to be JSON first
(:mod:`peer.tasks.config`), so whatever resolves can be described by ``task.spec()`` and rebuilt elsewhere.

A plug-in runs its module's code when imported. A name the user typed may import any module (``allowed_modules``
None); a name read from the network is resolved with the set of modules the user allowed (``--allow-task``), and
any other plug-in raises :class:`~peer.tasks.errors.PluginNotAllowed` before anything is imported.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from typing import Any

from peer.tasks.addition import AdditionTask
from peer.tasks.base import Task
from peer.tasks.config import normalize_config
from peer.tasks.errors import PluginNotAllowed, TaskError

_BUILTINS: dict[str, Callable[[Mapping[str, Any]], Task]] = {
    AdditionTask.name: AdditionTask.from_config,
}


def builtin_task_names() -> list[str]:
    """Names of the tasks that ship with hivegrpo."""
    return sorted(_BUILTINS)


def get_task(
    name: str, config: Mapping[str, Any] | None = None, *, allowed_modules: Collection[str] | None = None
) -> Task:
    """The task called ``name`` built with ``config`` (``None`` means defaults); :class:`TaskError` if impossible.

    :param allowed_modules: the plug-in modules that may be imported (exact names, the part before ``:``); None,
      for a name the local user gave, allows any. Built-in and reasoning-gym tasks are always allowed.
    """
    if not isinstance(name, str) or not name:
        raise TaskError(f"A task name must be a non-empty string, got {name!r}.")
    if isinstance(allowed_modules, str):
        raise TypeError("allowed_modules is a collection of module names, not one string")
    config = normalize_config(config)
    if name in _BUILTINS:
        return _BUILTINS[name](config)
    if ":" in name:
        from peer.tasks.plugin import PluginTask, plugin_module

        module = plugin_module(name)
        if allowed_modules is not None and module not in allowed_modules:
            raise PluginNotAllowed(name, module)
        return PluginTask(name, config)
    from peer.tasks import gym

    try:
        names = gym.dataset_names()
    except TaskError:
        names = []
    if name in names:
        return gym.ReasoningGymTask(name, config)
    close = difflib.get_close_matches(name, builtin_task_names() + names, n=3)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise TaskError(
        f"Unknown task {name!r}: {hint}use a built-in task ({', '.join(builtin_task_names())}), a reasoning-gym "
        "dataset name such as 'chain_sum' or 'basic_arithmetic' (peer.tasks.gym.dataset_names() lists them"
        f"{'' if names else '; reasoning-gym is not installed'}), or a plug-in written as 'module:attribute'."
    )
