"""Checking a rollout group against the run before anything learns from it. A peer's claims are never trusted.

:func:`check_group` answers, for a group read from a bucket and the key that signed it, either ``None`` (it is
what it says) or the *reason* it is refused, one short name from :data:`REASONS` plus a sentence. It checks:

* shape: G completions as the run says, each at most ``max_new_tokens`` long, every token id inside the
  tokenizer's vocabulary, the adapter version one the caller knows (with its sha256);
* the prompt: ``(task_seed, task_index)`` must be ``(prompt_seed(run_seed, owner), seq)``, and the prompt tokens
  must be exactly that example's prompt as :func:`peer.model.prompts.prompt_ids` renders it (the run's chat template);
* the rewards: recomputed from the completions' text (cut at the run's stop strings) and the regenerated example,
  they must equal the claims.

:func:`check_logprobs` recomputes the behaviour log-probs under a model holding the group's adapter — a spot check
a learner runs on a sample of groups, since it costs a forward pass. A group's behaviour log-probs are, by the
protocol, ``log_softmax(logits.float() / temperature)`` at each sampled token, with ``logits`` from the sampler's
model in its own compute dtype: honest peers may sample in float32, bfloat16 or float16 (no dtype is declared), so
the check never compares tokens one by one against a tight tolerance. :func:`judge_logprobs` tests a group's
tokens together (:class:`LogprobCheck`, calibrated on honest cross-precision groups):

* Δ = recomputed − claimed: its median |Δ| and mean |Δ| over the group's tokens, a hard cap on any one token's
  |Δ| far above rounding, and the net share of tokens moved one way (rounding goes both ways, a forger's shift
  does not);
* the sampling test: under honest sampling Σ log p(token) has mean −Σ H and variance Σ Var (entropy and
  log-prob variance of each token's recomputed distribution), so ``z = (Σ log p + Σ H) / sqrt(Σ Var + 1)`` is
  about N(0, 1); a far negative z is text this adapter version would not write (sampled from another version,
  or chosen), a far positive one text too likely to have been sampled (its likeliest tokens, picked by hand).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from peer.model.prompts import completion_text, prompt_ids
from peer.protocol import GroupRecord
from peer.run.spec import RunSpec, prompt_seed

REASONS = (
    "shape",
    "vocabulary",
    "version",
    "lineage",
    "prompt",
    "reward",
    "logprobs",
    # a learner's intake (peer.roles.learner.intake) adds these
    "schema",
    "unavailable",
    "replay",
    "unknown_version",
    "surplus",
    "busy",
    # found in the update's own forward (peer.roles.learner.update.share_gradient)
    "improbable",
)
REWARD_TOLERANCE = 1e-6
IMPROBABLE_LEAST = 2
"""A group is refused as ``improbable`` only with at least this many tokens below the run's ``token_floor``..."""
IMPROBABLE_ALPHA = 1e-6
"""... and only when honest sampling would hold that many less often than this (a Poisson tail with the mean the
policy's own distributions give): ~0.002 false refusals in 2,000 honest groups where the mean is right."""
SIGNER_LEAST, SIGNER_SLACK, SIGNER_ALPHA = 3, 2.0, 1e-9
"""A signer's groups in updates, summed (the intake keeps the sums), are refused with at least ``SIGNER_LEAST``
tokens below the floor and a Poisson tail below ``SIGNER_ALPHA`` against ``SIGNER_SLACK`` times their expected
count: tested again at every update, so a slightly biased expectation (the policy moved since the group was sampled,
another dtype sampled it) must not add up to a ban over a long run; honest signers measured 0.98 (float32) and
1.04 (bfloat16) times it (``python -m tests.benchmarks.poisoning``)."""
Z_VARIANCE_FLOOR = 1.0
"""Added to Σ Var under the sampling test's square root (nats²): a group of near-certain tokens has Σ Var ≈ 0, and
one honest sample of a rare token would otherwise make its z huge."""


class Refused(str):
    """A refusal: ``reason`` (one of :data:`REASONS`) and the sentence saying what was wrong."""

    reason: str

    def __new__(cls, reason: str, message: str) -> Refused:
        value = super().__new__(cls, f"{reason}: {message}")
        value.reason = reason
        return value

    def __reduce__(self):  # pickled as its two parts (the checking process sends verdicts back)
        return Refused, (self.reason, str(self)[len(self.reason) + 2 :])


def check_group(
    group: GroupRecord,
    owner: bytes,
    spec: RunSpec,
    tokenizer,
    known_adapter: Callable[[int], str | None],
) -> Refused | None:
    """``None`` if ``group`` (signed by ``owner``) is honest as far as can be checked without a model."""
    s = spec.sampling
    if len(group.completions) != s.group_size:
        return Refused("shape", f"{len(group.completions)} completions, the run samples {s.group_size}")
    vocab = len(tokenizer)
    prompt = group.prompt_tokens()
    completions = [c.tokens() for c in group.completions]
    for tokens in completions:
        if len(tokens) > s.max_new_tokens:
            return Refused("shape", f"a completion of {len(tokens)} tokens, the run allows {s.max_new_tokens}")
    if any(t >= vocab for t in prompt) or any(t >= vocab for c in completions for t in c):
        return Refused("vocabulary", f"token ids outside the vocabulary of {vocab}")
    sha = known_adapter(group.version)
    if sha is None:
        return Refused("version", f"adapter version {group.version} is not one this reader knows")
    if sha != group.adapter_sha256:
        return Refused(  # made under another lineage's v (two learners leading at once): ignored, not banned
            "lineage", f"adapter v{group.version} is {sha[:12]}…, the group says {group.adapter_sha256[:12]}…"
        )
    expected_seed = prompt_seed(spec.seed, owner)
    if (group.task_seed, group.task_index) != (expected_seed, group.seq):
        return Refused(
            "prompt", f"example ({group.task_seed}, {group.task_index}) is not this peer's for seq {group.seq}"
        )
    example = spec.task.example(expected_seed, group.seq)
    if prompt_ids(tokenizer, spec.prompt, example.prompt) != prompt:
        return Refused("prompt", "the prompt tokens are not the rendered prompt of its example")
    for i, (tokens, claimed) in enumerate(zip(completions, group.rewards, strict=True)):
        text = completion_text(tokenizer, tokens, spec.prompt.stop)
        reward = spec.task.reward(text, example)
        if abs(reward - claimed) > REWARD_TOLERANCE:
            return Refused("reward", f"completion {i} scores {reward:g}, the group claims {claimed:g}")
    return None


def pack_rows(groups: list[GroupRecord], pad_id: int, device):
    """Every completion of ``groups`` as one row in the layout of :func:`peer.grpo.completion_logprobs`: the prompt
    left-padded with ``pad_id`` (mask 0 there), the completion right-padded. Returns ``(prompt_ids, prompt_mask,
    completion_ids, completion_mask)``."""
    import torch

    prompts = [g.prompt_tokens() for g in groups for _ in g.completions]
    completions = [c.tokens() for g in groups for c in g.completions]
    P, C = max(len(p) for p in prompts), max(len(c) for c in completions)
    return (
        torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts], dtype=torch.long, device=device),
        torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device),
        torch.tensor([c + [pad_id] * (C - len(c)) for c in completions], dtype=torch.long, device=device),
        torch.tensor([[True] * len(c) + [False] * (C - len(c)) for c in completions], device=device),
    )


@dataclass(frozen=True)
class LogprobCheck:
    """The thresholds of the log-prob spot check (:func:`judge_logprobs`), each with what honest peers reached in
    ``python -m tests.benchmarks.verification`` (docs/reliability.md, Verification).

    Honest peers sample in float32, bfloat16 or float16 and a verifier recomputes in its own dtype, so a claimed
    log-prob is rarely exactly the recomputed one: on the bundled model a bf16 sampler and an fp32 verifier (or
    the reverse) differ by under 0.03 nats on most tokens but by up to ~4 nats on a few, where the model is
    sensitive. No per-token tolerance separates that from a lie, so every threshold is a statistic over all the
    completion tokens of a group (Δ = recomputed − claimed), set with a margin above the honest worst.
    """

    median_abs: float = field(
        default=0.05, metadata={"help": "most median |Δ| over a group's tokens, nats (honest worst: 0.039)"}
    )
    mean_abs: float = field(default=1.0, metadata={"help": "most mean |Δ| over a group's tokens (honest worst: 0.49)"})
    max_abs: float = field(default=8.0, metadata={"help": "most |Δ| on any one token, nats (honest worst: 4.2)"})
    drift: float = field(
        default=0.02, metadata={"help": "a token whose |Δ| is above this many nats moved, up or down"}
    )
    one_sided: float = field(
        default=0.7,
        metadata={
            "help": "most net share of a group's tokens that moved the same way, |#(Δ < -drift) - #(Δ > drift)| / n "
            "(honest noise goes both ways: 0.46; a forger shifting its claims moves them all one way)"
        },
    )
    z_low: float = field(
        default=-8.0,
        metadata={
            "help": "least sampling z of a group: text far less likely than sampled text (not sampled from this "
            "adapter version; honest worst: -5.5)"
        },
    )
    z_high: float = field(
        default=6.0,
        metadata={"help": "most sampling z of a group: text far more likely than sampled text (honest worst: 2.5)"},
    )

    def __post_init__(self):
        for name in ("median_abs", "mean_abs", "max_abs", "drift"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"LogprobCheck.{name} must be a positive number of nats, got {value!r}")
        if not self.median_abs <= self.mean_abs <= self.max_abs:
            raise ValueError(
                f"LogprobCheck needs median_abs <= mean_abs <= max_abs, got {self.median_abs}, {self.mean_abs} and "
                f"{self.max_abs}: raise the larger ones"
            )
        if not 0.0 < self.one_sided <= 1.0:
            raise ValueError(f"LogprobCheck.one_sided must be in (0, 1], got {self.one_sided!r}")
        if not (math.isfinite(self.z_low) and math.isfinite(self.z_high) and self.z_low < 0 < self.z_high):
            raise ValueError(f"LogprobCheck needs finite z_low < 0 < z_high, got {self.z_low} and {self.z_high}")

    @classmethod
    def with_tolerance(cls, tolerance: float) -> LogprobCheck:
        """The learner's ``--logprob-tolerance``: ``median_abs = tolerance``, and ``mean_abs``, ``max_abs`` and
        ``drift`` scaled by the same factor from their defaults (0.05 gives the default check; 0.1 doubles every
        nat threshold). The share and the z bounds do not depend on it."""
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not tolerance > 0:
            raise ValueError(f"the log-prob tolerance must be a positive number of nats, got {tolerance!r}")
        d = cls()
        scale = tolerance / d.median_abs
        return replace(
            d, median_abs=tolerance, mean_abs=d.mean_abs * scale, max_abs=d.max_abs * scale, drift=d.drift * scale
        )


@dataclass(frozen=True)
class TokenRows:
    """One completion's recomputed per-token values (python floats, one per token)."""

    logprobs: list[float]
    entropy: list[float]
    variance: list[float]


@dataclass(frozen=True)
class GroupLogprobStats:
    """A group's completion tokens summarized (Δ = recomputed − claimed): what :func:`judge_logprobs` judges."""

    tokens: int
    median_abs: float
    mean_abs: float
    max_abs: float
    one_sided: float  # (#(Δ > drift) - #(Δ < -drift)) / tokens, in [-1, 1]: < 0 when claims are too high
    z: float  # (Σ log p + Σ H) / sqrt(Σ Var + Z_VARIANCE_FLOOR): about N(0, 1) for sampled text

    @classmethod
    def of(cls, rows: list[TokenRows], claimed: list[list[float]], drift: float) -> GroupLogprobStats:
        """From the recomputed :class:`TokenRows` of each completion and its claimed log-probs (same lengths)."""
        deltas: list[float] = []
        logp_sum = entropy_sum = var_sum = 0.0
        for row, claim in zip(rows, claimed, strict=True):
            if len(claim) != len(row.logprobs):
                raise ValueError(f"{len(claim)} claimed log-probs for a completion of {len(row.logprobs)} tokens")
            deltas += [r - c for r, c in zip(row.logprobs, claim, strict=True)]
            logp_sum += sum(row.logprobs)
            entropy_sum += sum(row.entropy)
            var_sum += sum(row.variance)
        n = len(deltas)
        if n == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        absolute = sorted(abs(d) for d in deltas)
        median = (absolute[(n - 1) // 2] + absolute[n // 2]) / 2
        moved = sum(d > drift for d in deltas) - sum(d < -drift for d in deltas)
        z = (logp_sum + entropy_sum) / math.sqrt(var_sum + Z_VARIANCE_FLOOR)
        return cls(n, median, sum(absolute) / n, absolute[-1], moved / n, z)


def judge_logprobs(stats: GroupLogprobStats, check: LogprobCheck) -> Refused | None:
    """``None`` if a group's :class:`GroupLogprobStats` pass ``check``, else the refusal saying which test failed."""
    n = stats.tokens
    if n == 0:
        return None
    if stats.max_abs > check.max_abs:
        return Refused(
            "logprobs",
            f"a behaviour log-prob differs from the recomputed one by {stats.max_abs:.3g} nats (honest peers stay "
            f"under {check.max_abs:g} on every token, in any dtype)",
        )
    if stats.mean_abs > check.mean_abs:
        return Refused(
            "logprobs",
            f"behaviour log-probs differ from the recomputed ones by {stats.mean_abs:.3g} nats on average over {n} "
            f"tokens (honest peers stay under {check.mean_abs:g})",
        )
    if stats.median_abs > check.median_abs:
        return Refused(
            "logprobs",
            f"behaviour log-probs differ from the recomputed ones by a median {stats.median_abs:.3g} nats over {n} "
            f"tokens (honest peers stay under {check.median_abs:g})",
        )
    if abs(stats.one_sided) > check.one_sided:
        way = "higher" if stats.one_sided < 0 else "lower"
        return Refused(
            "logprobs",
            f"{abs(stats.one_sided):.0%} more of {n} behaviour log-probs are {way} than recomputed than the other "
            f"way by over {check.drift:g} nats (honest rounding goes both ways: under {check.one_sided:.0%})",
        )
    if stats.z < check.z_low:
        return Refused(
            "logprobs",
            f"the completions are far less likely than sampled text (z = {stats.z:.1f} over {n} tokens, honest "
            f"groups stay above {check.z_low:g}): not sampled from this adapter version",
        )
    if stats.z > check.z_high:
        return Refused(
            "logprobs",
            f"the completions are far more likely than sampled text (z = {stats.z:.1f} over {n} tokens, honest "
            f"groups stay under {check.z_high:g}): chosen, not sampled",
        )
    return None


def logprob_stats(model, groups: list[GroupRecord], spec: RunSpec, drift: float) -> list[GroupLogprobStats]:
    """Each group's :class:`GroupLogprobStats`, its tokens recomputed under ``model`` in one forward pass (each
    group's prompt once: ``share_prompts``)."""
    import torch

    from peer.grpo.logprobs import completion_token_stats

    prompt_ids, prompt_mask, ids, _ = pack_rows(groups, 0, next(model.parameters()).device)
    with torch.no_grad():
        t = completion_token_stats(model, prompt_ids, prompt_mask, ids, spec.sampling.temperature, share_prompts=True)
    logprobs, entropy, variance = t.logprobs.tolist(), t.entropy.tolist(), t.variance.tolist()
    out, row = [], 0
    for g in groups:
        rows, claimed = [], []
        for completion in g.completions:
            n = len(completion.tokens())
            rows.append(TokenRows(logprobs[row][:n], entropy[row][:n], variance[row][:n]))
            claimed.append(completion.behaviour_logprobs())
            row += 1
        out.append(GroupLogprobStats.of(rows, claimed, drift))
    return out


def check_logprobs(
    model, group: GroupRecord, spec: RunSpec, tolerance: float | None = None, *, check: LogprobCheck | None = None
) -> Refused | None:
    """Recompute the behaviour log-probs of ``group`` under ``model`` (holding the group's adapter) and judge them
    (:func:`judge_logprobs`) with ``check``, or ``LogprobCheck.with_tolerance(tolerance)``, or the default."""
    return check_logprobs_many(model, [group], spec, tolerance, check=check)[0]


def check_logprobs_many(
    model,
    groups: list[GroupRecord],
    spec: RunSpec,
    tolerance: float | None = None,
    *,
    check: LogprobCheck | None = None,
) -> list[Refused | None]:
    """:func:`check_logprobs` for several groups of one adapter version in one forward pass.

    One pass matters on a quantized base: each forward dequantizes every layer whatever the batch, so on the
    bundled nf4 model one group alone cost about as much as four together.
    """
    if check is not None and tolerance is not None:
        raise ValueError("pass either a tolerance or a LogprobCheck, not both")
    if check is None:
        check = LogprobCheck() if tolerance is None else LogprobCheck.with_tolerance(tolerance)
    return [judge_logprobs(s, check) for s in logprob_stats(model, groups, spec, check.drift)]


def poisson_tail(k: int, mean: float) -> float:
    """``P(X >= k)`` for ``X ~ Poisson(mean)``."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    if k <= mean:  # the bulk: one minus the few terms below k
        term, below = math.exp(-mean), 0.0
        for i in range(k):
            below += term
            term *= mean / (i + 1)
        return max(0.0, 1.0 - below)
    term = math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))  # the tail: its terms only fall from here
    total, i = 0.0, k
    while term > 1e-18 * total and i < k + 1000:
        total += term
        i += 1
        term *= mean / i
    return min(1.0, total)


def judge_improbable(observed: int, expected: float, floor: float) -> Refused | None:
    """Refused when a group's completions hold ``observed`` tokens the policy gives less than ``floor``, far more
    than the ``expected`` count honest sampling from it gives (:data:`IMPROBABLE_LEAST`, :data:`IMPROBABLE_ALPHA`):
    text written around the right answer, not sampled."""
    if observed < IMPROBABLE_LEAST or poisson_tail(observed, expected) >= IMPROBABLE_ALPHA:
        return None
    return Refused(
        "improbable",
        f"{observed} of its completion tokens have probability under {floor:g} for the policy, where sampled "
        f"text would hold {expected:.2g}: written, not sampled",
    )


def group_evidence(evidence, group_size: int) -> list[tuple[int, float]]:
    """Each group's ``(tokens below the floor, their expected count)`` from its rows' ``evidence``
    (``Share.evidence``), the batch's groups in order."""
    observed, expected = evidence
    observed = observed.view(-1, group_size).sum(1).tolist()
    expected = expected.view(-1, group_size).sum(1).tolist()
    return [(int(o), float(e)) for o, e in zip(observed, expected, strict=True)]


def judge_signer(observed: int, expected: float, floor: float) -> Refused | None:
    """Refused when a signer's groups in updates, together, hold far more tokens below ``floor`` than twice what
    sampling gives (:data:`SIGNER_SLACK`, :data:`SIGNER_ALPHA`): one written token per group, each group alone
    within what sampling gives now and then, adds up."""
    slack = SIGNER_SLACK * expected
    if observed < SIGNER_LEAST or poisson_tail(observed, slack) >= SIGNER_ALPHA:
        return None
    return Refused(
        "improbable",
        f"its groups in updates hold {observed} tokens with probability under {floor:g} for the policy, where "
        f"sampled text would hold {expected:.2g}: written, not sampled",
    )
