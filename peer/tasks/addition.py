"""The built-in ``addition`` task: zero-padded fixed-width integer addition.

With ``digits=3`` the pair ``(7, 45)`` is the prompt ``"007+045="`` and the reference ``"0052"`` (the sum padded to
``digits + 1`` characters). The reward is 1.0 for the exact reference (surrounding whitespace ignored); otherwise
``partial_credit`` times the fraction of reference positions the completion gets right, compared character by
character, so with the default ``partial_credit=0.0`` it is a binary exact match.

Held-out partition: the pair ``(a, b)`` is held out iff ``derive_seed("addition-heldout", digits, a, b) % 100 == 0``
(about 1% of pairs). :meth:`AdditionTask.example` redraws deterministically until it leaves that partition, so no
training example is ever a held-out one; :meth:`AdditionTask.heldout` draws distinct pairs from inside it. Every
draw hashes with SHA-256 (see :mod:`peer.tasks.seeds`), so it is the same on every machine; ``example`` costs two
hashes and runs at well over 50k examples a second.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Mapping
from typing import Any

from peer.tasks.base import Example, Task, check_count, check_position
from peer.tasks.errors import TaskError
from peer.tasks.seeds import SEED_BITS, derive_seed, encode_part

HELDOUT_MODULUS = 100
MAX_DIGITS = 6
# Above this many pairs the partition cannot be listed, so held-out pairs are found by rejection sampling and at most
# MAX_SAMPLED_HELDOUT of them are handed out: far below the ~10**6 pairs the partition holds from digits=4 up.
ENUMERABLE_PAIRS = 10**6
MAX_SAMPLED_HELDOUT = 100_000
_OPTIONS = ("digits", "partial_credit")


def _draw(prefix: bytes, *parts: int) -> tuple[int, int]:
    """Two independent 64-bit integers from one SHA-256 of ``prefix`` and ``parts`` (derive_seed's encoding)."""
    digest = hashlib.sha256(prefix + b"".join(encode_part(p) for p in parts)).digest()
    return int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:16], "big")


class AdditionTask(Task):
    """``digits``-digit zero-padded addition; see the module docstring for prompts, reward and held-out set."""

    name = "addition"

    def __init__(self, digits: int = 3, partial_credit: float = 0.0) -> None:
        if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= MAX_DIGITS:
            raise TaskError(f"addition: digits must be an integer from 1 to {MAX_DIGITS}, got {digits!r}.")
        if (
            isinstance(partial_credit, bool)
            or not isinstance(partial_credit, int | float)
            or not (math.isfinite(partial_credit) and 0.0 <= partial_credit <= 1.0)
        ):
            raise TaskError(f"addition: partial_credit must be a number from 0 to 1, got {partial_credit!r}.")
        self.digits = digits
        self.partial_credit = float(partial_credit)
        self.config = {"digits": digits, "partial_credit": self.partial_credit}
        self._modulus = 10**digits
        self._example_prefix = encode_part("addition-example") + encode_part(digits)
        self._heldout_prefix = encode_part("addition-heldout") + encode_part(digits)
        self._draw_prefix = encode_part("addition-heldout-draw") + encode_part(digits)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AdditionTask:
        """Build from a config mapping, rejecting options this task does not have."""
        unknown = sorted(set(config) - set(_OPTIONS))
        if unknown:
            raise TaskError(
                f"addition: unknown option(s) {', '.join(unknown)}; valid options are {', '.join(_OPTIONS)}."
            )
        return cls(**config)

    def is_heldout(self, a: int, b: int) -> bool:
        """Whether ``(a, b)`` is held out: ``derive_seed("addition-heldout", digits, a, b) % 100 == 0``."""
        digest = hashlib.sha256(self._heldout_prefix + encode_part(a) + encode_part(b)).digest()
        return (int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)) % HELDOUT_MODULUS == 0

    def make_example(self, a: int, b: int, seed: int = 0, index: int = 0) -> Example:
        """The example for the pair ``(a, b)``, e.g. ``"007+045="`` / ``"0052"`` for 7 and 45 with digits=3."""
        if not (0 <= a < self._modulus and 0 <= b < self._modulus):
            raise TaskError(f"addition: operands must be from 0 to {self._modulus - 1} for digits={self.digits}.")
        d = self.digits
        return Example(prompt=f"{a:0{d}d}+{b:0{d}d}=", reference=f"{a + b:0{d + 1}d}", seed=seed, index=index)

    def example(self, seed: int, index: int) -> Example:
        check_position(seed, index)
        attempt = 0
        while True:
            x, y = _draw(self._example_prefix, seed, index, attempt)
            a, b = x % self._modulus, y % self._modulus
            if not self.is_heldout(a, b):
                return self.make_example(a, b, seed, index)
            attempt += 1

    def reward(self, completion: str, reference: Example) -> float:
        answer, target = completion.strip(), reference.reference
        if answer == target:
            return 1.0
        if self.partial_credit == 0.0 or not target:
            return 0.0
        matches = sum(1 for got, want in zip(answer, target, strict=False) if got == want)
        return self.partial_credit * matches / len(target)

    def is_correct(self, completion: str, reference: Example) -> bool:
        return completion.strip() == reference.reference

    def heldout(self, n: int, seed: int = 0) -> list[Example]:
        """``n`` distinct held-out pairs in a seed-determined order (a larger ``n`` extends a smaller one)."""
        check_count(n)
        check_position(seed, 0)
        if self._modulus**2 <= ENUMERABLE_PAIRS:
            pairs = list(_partition(self.digits))
            if n > len(pairs):
                raise TaskError(
                    f"addition: asked for {n} held-out examples but digits={self.digits} holds only {len(pairs)}; "
                    "ask for fewer or use more digits."
                )
            random.Random(derive_seed("addition-heldout-draw", self.digits, seed)).shuffle(pairs)
            chosen = pairs[:n]
        else:
            if n > MAX_SAMPLED_HELDOUT:
                raise TaskError(
                    f"addition: at most {MAX_SAMPLED_HELDOUT} held-out examples are drawn for digits="
                    f"{self.digits}, got n={n}; ask for fewer."
                )
            chosen, seen, k = [], set(), 0
            while len(chosen) < n:
                x, y = _draw(self._draw_prefix, seed, k)
                k += 1
                pair = (x % self._modulus, y % self._modulus)
                if pair not in seen and self.is_heldout(*pair):
                    seen.add(pair)
                    chosen.append(pair)
        return [self.make_example(a, b, seed, i) for i, (a, b) in enumerate(chosen)]


@functools.lru_cache(maxsize=MAX_DIGITS)
def _partition(digits: int) -> tuple[tuple[int, int], ...]:
    """Every held-out pair for ``digits``, in (a, b) order; only called where that is at most ENUMERABLE_PAIRS."""
    modulus = 10**digits
    prefix = encode_part("addition-heldout") + encode_part(digits)
    encoded = [encode_part(v) for v in range(modulus)]
    shift, sha256 = 64 - SEED_BITS, hashlib.sha256
    pairs = []
    for a in range(modulus):
        head = sha256(prefix + encoded[a])
        for b in range(modulus):
            h = head.copy()
            h.update(encoded[b])
            if (int.from_bytes(h.digest()[:8], "big") >> shift) % HELDOUT_MODULUS == 0:
                pairs.append((a, b))
    return tuple(pairs)
