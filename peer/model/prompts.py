"""From a task's question to prompt token ids, and from completion tokens back to the text a reward sees.

One function renders every prompt in the project, :func:`prompt_ids`: the rollout peer's sampler, the learner's
check that a group's prompt tokens are its example's (:func:`peer.roles.learner.verify.check_group`), evaluation and
the single-process reference loop all call it, so a prompt means the same tokens everywhere. With
``chat_template="none"`` it is the tokenizer's plain encoding of the question (with its special tokens, e.g. a BOS);
with ``"auto"`` it is the tokenizer's own chat template over an optional system turn and the question as the user
turn, ending with the assistant's generation prompt.

A completion ends at the first *end token* (:func:`end_token_ids`: every ``eos_token_id`` of the model's generation
config, which may be a list, and the tokenizer's eos) or once its text contains a stop string
(:class:`~peer.grpo.config.PromptConfig` ``stop``). :func:`completion_text` is the text a reward scores: the
completion decoded without special tokens, cut right after the first stop string to complete. The stop string stays
in: with ``stop=("</answer>",)`` the reward must still see the closing tag to extract the answer, and whatever else the
last token decoded to is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from peer.errors import UserError
from peer.grpo.config import PromptConfig


class PromptError(UserError, ValueError):
    """The run's prompt settings cannot be applied with this tokenizer (e.g. no chat template)."""


def check_prompt_config(tokenizer, prompt: PromptConfig) -> None:
    """Raise :class:`PromptError` when ``prompt`` asks for a chat template this tokenizer does not have."""
    if prompt.chat_template == "auto" and not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "the run asks for the tokenizer's chat template (chat_template=auto) but this model's tokenizer has none; "
            "host the run with --chat-template none, or use an instruct model whose tokenizer ships a template"
        )


def messages(prompt: PromptConfig, text: str) -> list[dict[str, str]]:
    """The chat turns of a question: the system prompt (when set) and the question as the user turn."""
    system = [{"role": "system", "content": prompt.system_prompt}] if prompt.system_prompt else []
    return [*system, {"role": "user", "content": text}]


def prompt_ids(tokenizer, prompt: PromptConfig, text: str) -> list[int]:
    """The token ids of the prompt for question ``text`` under the run's prompt settings."""
    if prompt.chat_template == "none":
        return list(tokenizer(text)["input_ids"])
    check_prompt_config(tokenizer, prompt)
    ids = tokenizer.apply_chat_template(messages(prompt, text), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding, 4.x a plain list
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def end_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a completion: the model's generation-config eos (an int or a list) and the
    tokenizer's eos, sorted, without duplicates."""
    found: set[int] = set()

    def add(value) -> None:
        if value is None:
            return
        for v in value if isinstance(value, Iterable) else [value]:
            if v is not None:
                found.add(int(v))

    add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    add(tokenizer.eos_token_id)
    if not found:
        raise PromptError("neither the model's generation config nor its tokenizer names an end-of-sequence token")
    return tuple(sorted(found))


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to and including the stop string that completes first (the earliest end of a first occurrence),
    as decoding stops at the token that completes it."""
    cut = len(text)
    for s in stop:
        at = text.find(s)
        if at >= 0:
            cut = min(cut, at + len(s))
    return text[:cut]


def completion_text(tokenizer, tokens: Sequence[int], stop: Sequence[str] = ()) -> str:
    """The text a reward scores: ``tokens`` decoded without special tokens, cut after the first stop string."""
    return cut_at_stop(tokenizer.decode(list(tokens), skip_special_tokens=True), stop)


__all__ = [
    "PromptError",
    "check_prompt_config",
    "completion_text",
    "cut_at_stop",
    "end_token_ids",
    "messages",
    "prompt_ids",
]
