"""The log-prob spot check on the bundled model: honest groups sampled in bfloat16 pass a float32 verifier, lies do
not. The adapter is trained a few GRPO steps first, so its LoRA is not the all-zero-B initial one; the sampler is
built as :mod:`tests.benchmarks.verification` builds it (docs/reliability.md, Verification, has the full-size
table)."""

import pytest
import torch

from peer.roles.learner.verify import LogprobCheck, check_logprobs, check_logprobs_many
from tests.benchmarks import verification as bench
from tests.helpers.records import changed

torch.set_num_threads(1)

GROUPS = 160


@pytest.fixture(scope="module")
def run():
    spec = bench.run_spec()
    versions = bench.train_versions(spec, 4)
    verifier, tokenizer = bench.load_model("float32", spec.lora)
    bench.set_lora(verifier, versions[-1])
    sampler, _ = bench.load_model("bfloat16", spec.lora)
    bench.set_lora(sampler, versions[-1])
    assert next(p for n, p in sampler.named_parameters() if "norm" in n).dtype == torch.bfloat16
    groups = bench.sample(sampler, tokenizer, spec, range(GROUPS), seed=7)
    return spec, verifier, tokenizer, groups


def verdicts(run, groups):
    spec, verifier = run[0], run[1]
    out = []
    for i in range(0, len(groups), bench.CHUNK):
        out += check_logprobs_many(verifier, groups[i : i + bench.CHUNK], spec)
    return out


def test_groups_sampled_in_bfloat16_pass_a_float32_verifier(run):
    spec, verifier, _, groups = run
    found = verdicts(run, groups)
    assert [str(r) for r in found if r is not None] == [], "an honest bf16 peer would be banned"
    stats = bench.stats_of(verifier, groups, spec, LogprobCheck())
    assert max(s.max_abs for s in stats) > 0.05, "the old per-token 0.05 would have refused some of these"


@pytest.mark.parametrize(("how", "least"), [("+0.3", 0.9), ("x0.5", 0.8)])
def test_forged_logprobs_are_refused(run, how, least):
    found = verdicts(run, bench.forged(run[3], how))
    refused = [r for r in found if r is not None]
    assert len(refused) >= least * len(found), f"{len(refused)} of {len(found)} refused"
    assert all(r.reason == "logprobs" and "honest" in r for r in refused)


def test_claims_of_certainty_are_refused(run):
    spec, verifier, _, groups = run
    from peer.protocol import Completion

    certain = changed(
        groups[0], completions=[Completion.of(c.tokens(), [0.0] * len(c.tokens())) for c in groups[0].completions]
    )
    refused = check_logprobs(verifier, certain, spec)
    assert refused is not None and refused.reason == "logprobs"


def test_teacher_forced_answers_are_refused_where_the_model_would_not_write_them(run):
    spec, verifier, tokenizer, groups = run
    picked = bench.cherry_picked(verifier, tokenizer, groups, spec, spec.sampling.group_size)
    found = verdicts(run, picked)
    refused = [r for r in found if r is not None]
    assert refused, "no teacher-forced group refused"
    assert all("not sampled from this adapter version" in r for r in refused), "only the sampling test can tell"
