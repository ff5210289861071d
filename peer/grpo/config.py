"""GRPO hyperparameters: how groups are sampled, how the loss is shaped, how staleness is handled.

Each config is a frozen dataclass that checks itself on construction and round-trips through plain dicts
(:meth:`to_dict` / :meth:`from_dict`), because the coordinator publishes them in the run manifest and every peer
must read back exactly the values the run was started with. :meth:`from_dict` refuses keys it does not know: a
manifest written by a newer version must fail loudly, not lose a setting. Each field's help text is in its
``metadata["help"]`` (see :meth:`field_help`), for the command line and the docs.

This module imports no torch: the coordinator and every peer parse a manifest with it before (or without) loading
a model. :mod:`peer.grpo.staleness` imports it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

_C = TypeVar("_C", bound="_DictConfig")


class _DictConfig:
    """Dict round-trip and field checks shared by the configs below (plain scalars, and tuples of strings)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, ready for JSON or msgpack."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any]) -> _C:
        """Build from a dict such as :meth:`to_dict` returns; missing keys take their defaults, unknown keys fail."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}.from_dict expects a mapping, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; known fields are {sorted(known)}.")
        return cls(**data)

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Help text of each field, by name."""
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    def _int(self, name: str, low: int, high: int | None = None) -> None:
        value = getattr(self, name)
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{type(self).__name__}.{name} must be an int {allowed}, got {value!r}.")
        if value < low or (high is not None and value > high):
            raise ValueError(f"{type(self).__name__}.{name} must be in {allowed}, got {value}.")

    def _float(self, name: str, allowed: str, ok: Callable[[float], bool]) -> None:
        """Check a float field against ``ok``, whose range ``allowed`` spells out; ints are stored as floats."""
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{type(self).__name__}.{name} must be a finite number {allowed}, got {value!r}.")
        object.__setattr__(self, name, float(value))
        if not ok(float(value)):
            raise ValueError(f"{type(self).__name__}.{name} must be {allowed}, got {value}.")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class SamplingConfig(_DictConfig):
    """How a rollout peer samples a GRPO group.

    Sampling is plain temperature sampling (no top-k / top-p): the behaviour log-probs stored with a group are
    then ``log_softmax(logits / temperature)``, which a learner can recompute from the tokens alone. A truncated
    distribution would need the truncation replayed exactly, and a token outside it would have probability zero.
    """

    group_size: int = field(default=8, metadata=_help("G, completions sampled per prompt; advantages compare them"))
    temperature: float = field(default=1.0, metadata=_help("softmax temperature for sampling and log-probs, > 0"))
    max_new_tokens: int = field(default=6, metadata=_help("completion length cap in tokens; a longer one is cut"))

    def __post_init__(self) -> None:
        self._int("group_size", 2, 256)
        self._float("temperature", "> 0", lambda v: v > 0)
        self._int("max_new_tokens", 1, 4096)


CHAT_TEMPLATES = ("none", "auto")
MAX_SYSTEM_PROMPT_CHARS = 1024
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 32


@dataclass(frozen=True)
class PromptConfig(_DictConfig):
    """How a task's question becomes the model's prompt tokens, and which strings end a completion.

    Every peer renders prompts with :func:`peer.model.prompts.prompt_ids` from this config: a rollout peer to sample,
    a learner to check that a group's prompt tokens are its example's, the evaluator to score. The defaults are the
    raw question with no template and no stop strings (base models, the bundled model). An instruct model wants
    ``chat_template="auto"``: its tokenizer's own template, with ``system_prompt`` as the system turn.

    A manifest comes from anyone, so sizes are bounded: the system prompt and the stop strings travel inside the
    manifest's GRPO document, which the protocol caps at 4,096 characters.
    """

    chat_template: str = field(
        default="none",
        metadata=_help(
            "none: the question as plain text (today's prompts); auto: the tokenizer's own chat template, with"
            " the question as the user turn"
        ),
    )
    system_prompt: str = field(
        default="",
        metadata=_help(
            f"system turn of the chat template (at most {MAX_SYSTEM_PROMPT_CHARS} characters); empty: none, the"
            " template's own default applies; needs chat_template=auto"
        ),
    )
    stop: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            f"strings that end a completion once its text contains one (at most {MAX_STOP_STRINGS}, each 1 to"
            f" {MAX_STOP_CHARS} characters); the reward sees the text up to and including the first of them"
        ),
    )

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.chat_template, str) or self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(
                f"{name}.chat_template must be one of {list(CHAT_TEMPLATES)}, got {self.chat_template!r}."
            )
        if not isinstance(self.system_prompt, str):
            raise ValueError(f"{name}.system_prompt must be a string, got {type(self.system_prompt).__name__}.")
        if len(self.system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
            raise ValueError(
                f"{name}.system_prompt has {len(self.system_prompt)} characters, at most {MAX_SYSTEM_PROMPT_CHARS} "
                "are allowed; shorten it."
            )
        if self.system_prompt and self.chat_template == "none":
            raise ValueError(
                f"{name}.system_prompt needs a chat template to go into; set chat_template='auto' "
                "(--chat-template auto) or drop the system prompt."
            )
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
            raise ValueError(f"{name}.stop must be a list of strings, got {type(stop).__name__}.")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"{name}.stop holds {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed.")
        for s in stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"{name}.stop strings must have 1 to {MAX_STOP_CHARS} characters, got {s!r:.80}.")
        object.__setattr__(self, "stop", tuple(stop))


@dataclass(frozen=True)
class LossConfig(_DictConfig):
    """Shape of the clipped policy loss (see :func:`peer.grpo.loss.clipped_policy_loss`)."""

    clip_eps_low: float = field(
        default=0.2, metadata=_help("ratio is clipped below at 1 - clip_eps_low for negative advantages, in [0, 1)")
    )
    clip_eps_high: float = field(
        default=0.2, metadata=_help("ratio is clipped above at 1 + clip_eps_high for positive advantages, >= 0")
    )
    dual_clip: float = field(
        default=3.0,
        metadata=_help(
            "for negative advantages the surrogate is at least dual_clip * A (dual-clip PPO): a token whose ratio ran"
            " far above 1 under a stale policy cannot dominate the update; 0 disables it, else > 1 + clip_eps_high"
        ),
    )
    kl_beta: float = field(
        default=0.0, metadata=_help("weight of the k3 KL estimate to the base policy per token; 0 disables it")
    )
    adv_eps: float = field(default=1e-6, metadata=_help("advantages are (r - mean) / (std + adv_eps), > 0"))
    token_floor: float = field(
        default=1e-3,
        metadata=_help(
            "a completion token the learning policy gives less than this probability is not learned from, and a "
            "group holding far more such tokens than sampling gives is refused (written text, not sampled: "
            "docs/reliability.md, Poisoning); in [0, 0.1], 0 disables both"
        ),
    )

    def __post_init__(self) -> None:
        self._float("clip_eps_low", "in [0, 1)", lambda v: 0 <= v < 1)
        self._float("clip_eps_high", ">= 0", lambda v: v >= 0)
        self._float("dual_clip", "0 or > 1 + clip_eps_high", lambda v: v == 0 or v > 1 + self.clip_eps_high)
        self._float("kl_beta", ">= 0", lambda v: v >= 0)
        self._float("adv_eps", "> 0", lambda v: v > 0)
        self._float("token_floor", "in [0, 0.1]", lambda v: 0 <= v <= 0.1)


WEIGHTING_NAMES = ("constant", "polynomial", "exponential", "hinge")
"""The staleness weightings a manifest may name; :data:`peer.grpo.staleness.WEIGHTINGS` has a function for each."""


@dataclass(frozen=True)
class StalenessConfig(_DictConfig):
    """Which stale groups a learner drops and how it weights the rest (see :mod:`peer.grpo.staleness`).

    Only the knob of the chosen ``weighting`` matters: ``power`` for polynomial, ``decay`` for exponential,
    ``knee`` for hinge; constant has none.
    """

    tau_max: int = field(default=4, metadata=_help("drop groups more than tau_max adapter versions behind, >= 0"))
    weighting: str = field(
        default="polynomial", metadata=_help(f"weight w(tau) of an accepted group, one of {sorted(WEIGHTING_NAMES)}")
    )
    power: float = field(default=0.5, metadata=_help("polynomial: w = (1 + tau) ** -power, >= 0 (0 is constant)"))
    decay: float = field(default=0.5, metadata=_help("exponential: w = decay ** tau, in (0, 1] (1 is constant)"))
    knee: int = field(
        default=1,
        metadata=_help("hinge: w = 1 for tau <= knee, then linear to 0 at tau_max + 1; 0 <= knee <= tau_max"),
    )

    def __post_init__(self) -> None:
        self._int("tau_max", 0, 1024)
        if not isinstance(self.weighting, str) or self.weighting not in WEIGHTING_NAMES:
            raise ValueError(
                f"StalenessConfig.weighting must be one of {sorted(WEIGHTING_NAMES)}, got {self.weighting!r}."
            )
        self._float("power", ">= 0", lambda v: v >= 0)
        self._float("decay", "in (0, 1]", lambda v: 0 < v <= 1)
        self._int("knee", 0)
        if self.weighting == "hinge" and self.knee > self.tau_max:
            raise ValueError(
                f"StalenessConfig.knee={self.knee} must be <= tau_max={self.tau_max} for the hinge weighting; "
                "lower knee or raise tau_max."
            )
