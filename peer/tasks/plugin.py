"""Tasks from other packages: the ``module:attribute`` plug-in form.

``get_task("mypkg.tasks:MyTask", {"level": 2})`` imports ``mypkg.tasks`` and takes ``MyTask``, which may be

* a :class:`~peer.tasks.Task` instance (then the config must be empty),
* a ``Task`` subclass, called with ``**config``, or
* any other callable returning a ``Task``, called with ``**config``.

The result is wrapped in :class:`PluginTask`, whose ``name`` is the ``module:attribute`` reference and whose
``config`` is the config it was built with, so ``spec()`` rebuilds it through ``get_task`` on any peer that can
import the same module. Everything else (examples, reward, held-out set) is the plug-in's own.

Importing a module runs its code, so a task name that came from the network (a run's manifest) is resolved with
``allowed_modules``: :func:`~peer.tasks.get_task` refuses a module the local user did not allow before anything
here imports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from peer.tasks.base import Example, Task
from peer.tasks.errors import TaskError


def plugin_module(ref: str) -> str:
    """The module a plug-in reference ``module:attribute`` imports; :class:`TaskError` if it is not one."""
    module_name, _, attribute = ref.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise TaskError(f"Plug-in task {ref!r} must be written as 'module:attribute', e.g. 'mypkg.tasks:MyTask'.")
    return module_name


def _load_attribute(ref: str) -> Any:
    module_name = plugin_module(ref)
    attribute = ref.partition(":")[2]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the plug-in's own import raised
        raise TaskError(
            f"Plug-in task {ref!r}: importing module {module_name!r} failed ({type(exc).__name__}: {exc}); "
            "check that it is installed or on PYTHONPATH."
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise TaskError(
                f"Plug-in task {ref!r}: module {module_name!r} has no attribute {attribute!r}; "
                "check the name after ':'."
            ) from None
    return target


def _build(ref: str, target: Any, config: Mapping[str, Any]) -> Task:
    if isinstance(target, Task):
        if config:
            raise TaskError(
                f"Plug-in task {ref!r} is a ready-made Task instance and takes no config; pass an empty config or "
                "point at a Task class or factory instead."
            )
        return target
    if not callable(target):
        raise TaskError(
            f"Plug-in task {ref!r} is a {type(target).__name__}, not a Task instance, Task subclass or factory; "
            "point at one of those."
        )
    try:
        task = target(**config)
    except TaskError:
        raise
    except TypeError as exc:
        raise TaskError(f"Plug-in task {ref!r} rejected config {dict(config)} ({exc}); check its options.") from exc
    if not isinstance(task, Task):
        raise TaskError(
            f"Plug-in task {ref!r} returned a {type(task).__name__}, not a peer.tasks.Task; make the factory return "
            "a Task."
        )
    return task


class PluginTask(Task):
    """A plug-in's task under its ``module:attribute`` name; ``inner`` is the plug-in's own object."""

    def __init__(self, ref: str, config: Mapping[str, Any]) -> None:
        self.name = ref
        self.config = dict(config)
        self.inner = _build(ref, _load_attribute(ref), self.config)

    def example(self, seed: int, index: int) -> Example:
        return self.inner.example(seed, index)

    def reward(self, completion: str, reference: Example) -> float:
        return self.inner.reward(completion, reference)

    def is_correct(self, completion: str, reference: Example) -> bool:
        return self.inner.is_correct(completion, reference)

    def heldout(self, n: int, seed: int = 0) -> list[Example]:
        return self.inner.heldout(n, seed)
