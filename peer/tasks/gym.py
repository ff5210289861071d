"""reasoning-gym datasets as tasks.

Any reasoning-gym dataset name (``chain_sum``, ``basic_arithmetic``, ... ; :func:`dataset_names` lists them) is a
task whose config is passed through to ``reasoning_gym.create_dataset(name, size=..., seed=..., **config)``; ``size``
and ``seed`` belong to this module. reasoning-gym is imported only when such a task is built (it takes seconds).
For ``composite``, ``datasets`` is a list of ``{"name", "weight", "config"}`` objects, as in reasoning-gym's YAML.

How ``(seed, index)`` becomes an entry. A reasoning-gym dataset is a cheap object that generates item ``idx`` on the
fly, almost always from ``random.Random(dataset_seed + idx)``; a few datasets do real work when constructed (``acre``
builds all ``size`` questions up front, ``arc_agi``/``codeio``/``figlet_font`` load data files, ~0.1-0.2 s) and some
cap ``size`` (``word_ladder``: 20,000). So indices are grouped in chunks of :data:`CHUNK_SIZE`: chunk
``index // CHUNK_SIZE`` is a dataset of that size whose seed is ``derive_seed("reasoning-gym", stream, name, config,
seed, chunk, attempt) % SEED_SPACE``, and the example is its item ``index % CHUNK_SIZE``. The most recently used
datasets are kept in a small LRU cache, so consecutive indices cost one item generation each, and a new ``seed``
costs one dataset construction. Dataset seeds stay below 2**31 because some generators seed numpy (which needs
seeds below 2**32) with ``dataset_seed + idx``. Some generators give up on an unlucky seed (``word_ladder`` raises
and shrinks itself); then the damaged dataset is dropped and the next ``attempt`` seed is used.

The prompt is the entry's ``question`` verbatim, the reference is ``str(entry["answer"])``, and the reward is the
dataset's own ``score_answer``, clamped to ``[0, 1]``, on the completion's final answer: when the completion holds an
``<answer>…</answer>`` pair, the content of the last one (reasoning-gym's own ``utils.extract_answer``, as its
evaluations use it, so a model may reason before answering); otherwise the whole stripped completion, as the
dataset's ``score_answer`` reads it (some datasets parse the answer out of it themselves). A scorer that raises on
junk text scores 0.0. Instruct models learn the tag format from a system prompt such as reasoning-gym's
``SYSTEM_PROMPTS["direct"]`` (docs/models.md). A few datasets (``boxnet``, ``graph_color``, ``propositional_logic``,
``rubiks_cube``, ``rush_hour``) have no single oracle answer: their reference is ``"None"`` and only ``score_answer``
judges a completion.

The held-out set comes from a separate stream (``stream="heldout"``), distinct questions only. Unlike ``addition``
it is not a partition of the problem space, so a configuration with very few possible questions can repeat a
held-out question in training. In reasoning-gym 0.1.25 a few generators are not reproducible across processes
(``codeio`` at all; ``isomorphic_strings``, ``knight_swap``, ``polynomial_multiplication``, ``ransom_note`` and
``word_ladder`` only under the same ``PYTHONHASHSEED``), which no seed derivation here can repair.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from peer.log import get_logger
from peer.tasks.base import Example, Task, check_count, check_position
from peer.tasks.config import config_key
from peer.tasks.errors import TaskError
from peer.tasks.seeds import derive_seed

logger = get_logger(__name__)

CHUNK_SIZE = 256
SEED_SPACE = 2**31
CACHE_SIZE = 16
MAX_ATTEMPTS = 8
RESERVED_OPTIONS = ("size", "seed")
# heldout(n) gives up after this many draws beyond n when the dataset keeps repeating questions.
HELDOUT_SLACK = 4
HELDOUT_EXTRA = 64


def _reasoning_gym() -> ModuleType:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise TaskError(
            "reasoning-gym is not installed, so reasoning-gym task names cannot be used; pip install reasoning-gym."
        ) from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name the installed reasoning-gym registers (imports reasoning-gym)."""
    return sorted(_reasoning_gym().factory.DATASETS)


def final_answer(completion: str) -> str:
    """The answer a completion gives: the content of its last ``<answer>…</answer>`` (reasoning-gym's
    ``extract_answer``), else the whole completion, stripped."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion)
    return completion.strip() if tagged is None else tagged


def _options(name: str) -> list[str]:
    """The config options a dataset accepts: its config dataclass's fields, minus size and seed."""
    _, config_cls = _reasoning_gym().factory.DATASETS[name]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_OPTIONS]


class ReasoningGymTask(Task):
    """The reasoning-gym dataset ``name`` with ``config``; see the module docstring for how examples are derived."""

    def __init__(self, name: str, config: Mapping[str, Any]) -> None:
        if name not in dataset_names():
            close = difflib.get_close_matches(name, dataset_names(), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise TaskError(
                f"{name!r} is not a reasoning-gym dataset{hint}; peer.tasks.gym.dataset_names() lists them."
            )
        reserved = sorted(set(config) & set(RESERVED_OPTIONS))
        if reserved:
            raise TaskError(
                f"reasoning-gym task {name!r}: {', '.join(reserved)} cannot be configured, the task derives them "
                "from each example's (seed, index); remove them from the config."
            )
        self.name = name
        self.config = dict(config)
        self._key = config_key(self.config)
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._scorer = self._create(size=1, seed=0)  # also validates the config now, not at the first example

    def _create(self, size: int, seed: int) -> Any:
        kwargs = dict(self.config)
        try:
            if self.name == "composite" and isinstance(kwargs.get("datasets"), list):
                from reasoning_gym.composite import DatasetSpec

                kwargs["datasets"] = [DatasetSpec(**spec) for spec in kwargs["datasets"]]
            return _reasoning_gym().create_dataset(self.name, size=size, seed=seed, **kwargs)
        except Exception as exc:  # reasoning-gym validates with TypeError, AssertionError, ValueError, ...
            raise TaskError(
                f"reasoning-gym dataset {self.name!r} rejected config {self._key} ({type(exc).__name__}: {exc}); "
                f"its options are: {', '.join(_options(self.name)) or 'none'}."
            ) from exc

    def _dataset(self, dataset_seed: int) -> Any:
        """The chunk dataset for ``dataset_seed`` from the LRU cache; call with the lock held."""
        ds = self._cache.get(dataset_seed)
        if ds is None:
            ds = self._create(size=CHUNK_SIZE, seed=dataset_seed)
            self._cache[dataset_seed] = ds
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(dataset_seed)
        return ds

    def entry(self, stream: str, seed: int, index: int) -> dict[str, Any]:
        """The raw reasoning-gym entry that ``(stream, seed, index)`` names."""
        chunk, offset = divmod(index, CHUNK_SIZE)
        failure: Exception | None = None
        for attempt in range(MAX_ATTEMPTS):
            parts = ("reasoning-gym", stream, self.name, self._key, seed, chunk, attempt)
            dataset_seed = derive_seed(*parts) % SEED_SPACE
            with self._lock:  # generators keep per-item state on the dataset object
                ds = self._dataset(dataset_seed)
                try:
                    return ds[offset]
                except Exception as exc:  # a generator that gives up on this seed; it may have changed itself
                    self._cache.pop(dataset_seed, None)
                    failure = exc
            logger.debug("%s gave up on dataset seed %d (%s); trying the next one", self.name, dataset_seed, failure)
        raise TaskError(
            f"reasoning-gym dataset {self.name!r} failed to generate example ({seed}, {index}) {MAX_ATTEMPTS} times "
            f"(last error: {failure}); loosen its config {self._key}."
        ) from failure

    def _example(self, entry: Mapping[str, Any], seed: int, index: int) -> Example:
        question, answer = str(entry["question"]), str(entry["answer"])
        return Example(prompt=question, reference=answer, seed=seed, index=index, entry=entry)

    def example(self, seed: int, index: int) -> Example:
        check_position(seed, index)
        return self._example(self.entry("train", seed, index), seed, index)

    def reward(self, completion: str, reference: Example) -> float:
        if reference.entry is None:
            raise TaskError(
                f"reasoning-gym task {self.name!r} can only score examples it made (this one has no entry)."
            )
        try:
            score = float(self._scorer.score_answer(answer=final_answer(completion), entry=reference.entry))
        except Exception:  # scorers parse model text and some raise on junk; junk earns nothing
            return 0.0
        return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0

    def heldout(self, n: int, seed: int = 0) -> list[Example]:
        """The first ``n`` distinct questions of the held-out stream for ``seed``."""
        check_count(n)
        check_position(seed, 0)
        examples: list[Example] = []
        seen: set[str] = set()
        budget = HELDOUT_SLACK * n + HELDOUT_EXTRA
        draw = 0
        while len(examples) < n:
            if draw >= budget:
                raise TaskError(
                    f"reasoning-gym task {self.name!r} produced only {len(examples)} distinct questions in {draw} "
                    f"draws, fewer than the {n} held-out examples asked for; ask for fewer or widen its config."
                )
            entry = self.entry("heldout", seed, draw)
            draw += 1
            if entry["question"] not in seen:
                seen.add(entry["question"])
                examples.append(self._example(entry, seed, len(examples)))
        return examples
