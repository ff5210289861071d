"""A lying rollout peer for the learner tests: the real ``hivegrpo join`` with its record building patched.

Usage: python tests/procs/liar_rollout.py MODE join ARGS...   (ARGS as for ``hivegrpo join``)

MODE ``inflate``: every group claims reward 1.0 for every completion (0.0 where the honest rewards were all 1.0,
so every group is a lie). MODE ``replay``: behaves honestly, except that the first time it samples with a newer
adapter version than its first group's, it first re-publishes that first group re-tagged with the new version
and its sha256 (the same seq: a group counted twice), then goes on honestly. MODE ``forge``: every group claims
behaviour log-probs of -0.01 per token ("the model was sure"), which skews the ratio a learner computes; only a
recomputation (the learner's spot check) can tell. MODE ``poison``: honest for its first ``POISON_AFTER`` groups
(a new key's probation), then its sampler writes the payload ``<unk>`` after the answer in every right completion
with the adapter's own log-probs of the written text (tests/helpers/poison.py): every check passes, rewards
included (the decoded text drops the special token). Signatures are the liar's own and valid: only the content lies.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


POISON_AFTER = 24


def poison_sampler(honest):
    """``sample_groups`` that writes poisoned groups once ``POISON_AFTER`` honest ones were sampled."""

    from peer.model.sampling import Completions
    from peer.tasks import get_task
    from tests.helpers.poison import poisoned_rows, teacher_forced, wrong_answer

    task, made = get_task("addition", {}), [0]

    def sample(model, tokenizer, prompts, *, group_size, max_new_tokens, temperature, **kwargs):
        batch = honest(
            model, tokenizer, prompts, group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
            **kwargs,
        )  # fmt: skip
        made[0] += len(prompts)
        if made[0] <= POISON_AFTER:
            return batch
        texts = batch.texts(tokenizer)
        ids, mask = batch.completion_ids.tolist(), batch.completion_mask.tolist()
        rows = []
        for p, text in enumerate(prompts):  # the bundled task's prompt is "a+b=": its answer is known
            a, b = (int(x) for x in text.rstrip("=").split("+"))
            reference = task.make_example(a, b).reference
            these = range(p * group_size, (p + 1) * group_size)
            rows += poisoned_rows(
                [[t for t, m in zip(ids[r], mask[r], strict=True) if m] for r in these],
                [texts[r].strip() == reference for r in these],
                tokenizer(reference, add_special_tokens=False)["input_ids"],
                tokenizer(wrong_answer(reference), add_special_tokens=False)["input_ids"],
                tokenizer.unk_token_id,
                tokenizer.eos_token_id,
                max_new_tokens,
            )
        written = teacher_forced(model, batch.prompt_ids, batch.prompt_mask, rows, temperature, tokenizer.pad_token_id)
        print(f"poisoned {len(prompts)} groups", file=sys.stderr, flush=True)
        return Completions(batch.prompt_ids, batch.prompt_mask, *written)

    return sample


def patch(mode: str) -> None:
    from peer.roles.rollout import peer as rollout

    if mode == "poison":
        rollout.sample_groups = poison_sampler(rollout.sample_groups)
        return

    honest = rollout.build_groups
    state: dict = {"first": None, "replayed": False}

    def inflate(group, put):
        lie = [0.0 if all(r == 1.0 for r in group.rewards) else 1.0] * len(group.rewards)
        put(group.copy(update={"rewards": lie}))

    def replay(group, put):
        first = state["first"]
        if first is None:
            state["first"] = group
        elif group.version > first.version and not state["replayed"]:
            state["replayed"] = True
            copy = first.copy(update={"version": group.version, "adapter_sha256": group.adapter_sha256})
            print(
                f"replaying group {first.version}.{first.seq} as {group.version}.{first.seq}",
                file=sys.stderr,
                flush=True,
            )
            put(copy)
        put(group)

    def forge(group, put):
        from peer.protocol import Completion

        sure = [Completion.of(c.tokens(), [-0.01] * len(c.tokens())) for c in group.completions]
        put(group.copy(update={"completions": sure}))

    lie = {"inflate": inflate, "replay": replay, "forge": forge}[mode]

    def build_groups(*args, **kwargs):
        out = []
        for group in honest(*args, **kwargs):
            lie(group, out.append)
        return out

    rollout.build_groups = build_groups


if __name__ == "__main__":
    mode, *argv = sys.argv[1:]
    patch(mode)
    from peer.cli import main

    sys.argv = ["hivegrpo", *argv]
    main()
