"""What a task is: a deterministic problem generator plus a pure reward.

GRPO peers in a swarm never ship problems to each other; they ship a task *spec* (``{"name", "config"}``) and
``(seed, index)`` pairs, and each peer rebuilds the same :class:`Example` locally. That only works if

* :meth:`Task.example` is a pure function of ``(seed, index)`` on every machine and process,
* :meth:`Task.reward` is a pure function of the completion text and the example, in ``[0, 1]``, and never raises
  on whatever text a model produced,
* :meth:`Task.heldout` is a fixed evaluation set that training examples do not come from, and
* :meth:`Task.spec` is JSON that :func:`peer.tasks.get_task` turns back into an equal task.

Completions arrive as decoded text of the generated tokens, cut at end-of-sequence, special tokens removed; tasks
ignore leading and trailing whitespace.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from peer.tasks.config import config_key
from peer.tasks.errors import TaskError


@dataclass(frozen=True)
class Example:
    """One problem: the prompt text, its canonical answer, and where it came from.

    ``prompt`` is plain text for the tokenizer (no special tokens; chat templating is the model's business).
    ``entry`` holds task-private data the reward needs (a reasoning-gym entry, for instance); it takes no part in
    equality or hashing, and callers must not mutate it.
    """

    prompt: str
    reference: str
    seed: int
    index: int
    entry: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


class Task(abc.ABC):
    """A named, configured problem source with a reward; see the module docstring for the contract.

    Subclasses set ``name`` (the registry name) and ``config`` (the validated, JSON-compatible config) in their
    constructor and implement :meth:`example`, :meth:`reward` and :meth:`heldout`. Two tasks are equal when their
    specs are.
    """

    name: str
    config: Mapping[str, Any]

    @abc.abstractmethod
    def example(self, seed: int, index: int) -> Example:
        """The training example named by ``(seed, index)``; the same on every machine."""

    @abc.abstractmethod
    def reward(self, completion: str, reference: Example) -> float:
        """Score ``completion`` against ``reference`` in ``[0, 1]``; junk text scores, it does not raise."""

    def is_correct(self, completion: str, reference: Example) -> bool:
        """Exact-match criterion for evaluation: by default, full reward."""
        return self.reward(completion, reference) >= 1.0

    @abc.abstractmethod
    def heldout(self, n: int, seed: int = 0) -> list[Example]:
        """``n`` evaluation examples, deterministic in ``seed``, never produced by :meth:`example`."""

    def spec(self) -> dict[str, Any]:
        """``{"name": ..., "config": {...}}``; ``get_task(**task.spec())`` rebuilds an equal task."""
        return {"name": self.name, "config": json.loads(config_key(self.config))}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Task):
            return NotImplemented
        return (
            type(self) is type(other)
            and self.name == other.name
            and config_key(self.config) == config_key(other.config)
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.name, config_key(self.config)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={config_key(self.config)})"


def check_position(seed: int, index: int) -> None:
    """Reject a ``(seed, index)`` pair that does not name an example: both integers, ``index >= 0``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TaskError(f"An example seed must be an integer, got {seed!r}.")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TaskError(f"An example index must be a non-negative integer, got {index!r}.")


def check_count(n: int) -> None:
    """Reject a held-out size that is not a non-negative integer."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TaskError(f"A held-out set size must be a non-negative integer, got {n!r}.")
