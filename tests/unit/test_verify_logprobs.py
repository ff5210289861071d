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


def test_a_checking_process_gives_the_verdicts_of_a_check_on_the_loop(run):
    """The learner's spot checks beside its updates (peer.roles.learner.checker): the verdicts a forked child
    sends back are those of the same check on the learner's loop, under the LoRA tensors of the version each
    submission names (sent once per version); a child that dies is said, and what it held comes back."""
    import os
    import signal

    from peer.model.adapter import lora_parameters
    from peer.roles.learner.checker import Checker, CheckerGone

    spec, verifier = run[0], run[1]
    honest = run[3][:8]
    lies = bench.forged(run[3][8:16], "+0.3")
    held = [p.detach().clone() for p in lora_parameters(verifier)]
    other = [torch.zeros_like(t) if i % 2 else t for i, t in enumerate(held)]  # every LoRA B zero: the base alone
    here = [str(r) for r in check_logprobs_many(verifier, honest + lies, spec)]
    bench.set_lora(verifier, other)
    here_other = [str(r) for r in check_logprobs_many(verifier, honest, spec)]
    bench.set_lora(verifier, held)
    assert here[:8] == ["None"] * 8 and all(r != "None" for r in here[8:]), "the check itself tells them apart"
    assert here_other != ["None"] * 8, "the other version's tensors make other verdicts"
    checker = Checker(verifier, spec, LogprobCheck())
    try:
        checker.submit((5, "a"), held, honest + lies, 4, "first")
        checker.submit((6, "b"), other, honest, 4, "second")
        checker.submit((5, "a"), other, honest, 5, "third")  # (5, "a") is held there: its tensors are not sent again
        checker.submit((5, "c"), other, honest, 5, "fourth")  # another lineage's version 5 (a leader's state taken)
        assert (checker.in_flight, checker.groups_in_flight) == (4, 40), "counted until results() hands them back"
        answered = []
        while len(answered) < 4:
            answered += checker.results(timeout=30.0)
        assert [c for c, _ in answered] == ["first", "second", "third", "fourth"] and checker.in_flight == 0
        assert [str(r) for r in answered[0][1]] == here
        assert [str(r) for r in answered[1][1]] == here_other
        assert [str(r) for r in answered[2][1]] == here[:8]
        assert [str(r) for r in answered[3][1]] == here_other, "checked under that lineage's tensors, not the held"
        os.kill(checker.pid, signal.SIGKILL)
        checker._process.join(10)
        with pytest.raises(CheckerGone):
            checker.submit((6, "b"), other, honest, 5, "fifth")
            checker.results(timeout=10.0)
        assert checker.unanswered() in ([], ["fifth"])
    finally:
        checker.close()
    assert all(torch.equal(p, t) for p, t in zip(lora_parameters(verifier), held, strict=True)), "ours untouched"


def test_a_checking_process_that_falls_behind_leaves_the_checks_to_the_loop(run):
    """With ``CHECKS_IN_FLIGHT`` groups already with the checking process, the learner checks the next ones on its
    loop (under the version's own tensors, then its own back): the groups waiting on that process stay bounded
    however slow it is."""
    from types import SimpleNamespace

    from peer.model.adapter import lora_parameters
    from peer.roles.learner.intake import Accepted, Intake
    from peer.roles.learner.peer import CHECKS_IN_FLIGHT, LearnerPeer

    spec, verifier, tokenizer, groups = run
    held = [p.detach().clone() for p in lora_parameters(verifier)]

    class Behind:  # a checking process with CHECKS_IN_FLIGHT groups not answered yet
        in_flight, groups_in_flight = 4, CHECKS_IN_FLIGHT
        submitted = 0

        def results(self, timeout=0.0):
            return []

        def submit(self, *args):
            self.submitted += 1

    class Loop:  # the parts of a LearnerPeer its spot check uses
        _spot_check = LearnerPeer._spot_check
        _collect_checks = LearnerPeer._collect_checks
        _hand_checks_over = LearnerPeer._hand_checks_over
        _checked = LearnerPeer._checked

    loop = Loop()
    loop.session = SimpleNamespace(model=verifier, spec=spec, version=0)
    loop.state = SimpleNamespace(window={0: (bench.SHA, held)})
    loop.config = SimpleNamespace(logprob_tolerance=0.05)
    loop.checker = Behind()
    loop.intake = Intake(spec, tokenizer, batch=16, check_rate=1.0)
    honest, lies = groups[:4], bench.forged(groups[4:8], "+0.3")
    loop.intake.recheck([Accepted(bench.OWNER, g) for g in honest + lies])
    loop._spot_check()
    assert loop.checker.submitted == 0 and loop.intake.checks_waiting() == 0, "checked here, not handed over"
    assert loop.intake.counts["checked"] == 8 and bench.OWNER in loop.intake.banned, "the lies were found"
    assert all(torch.equal(p, t) for p, t in zip(lora_parameters(verifier), held, strict=True))
    loop.checker.groups_in_flight = CHECKS_IN_FLIGHT - 1
    loop.intake.recheck([Accepted(b"another signer", g) for g in honest])
    loop._spot_check()
    assert loop.checker.submitted == 1 and loop.intake.counts["checked"] == 8, "below the bound: handed over"
