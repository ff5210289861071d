"""Instruct models end to end: the prompt settings a manifest carries, the one function that renders a prompt, every
end token and stop string ending a row, finished rows leaving the batch without changing anyone's tokens, the
learner's prompt check under a chat template, and reasoning-gym's <answer> extraction."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from peer.grpo.config import MAX_STOP_STRINGS, MAX_SYSTEM_PROMPT_CHARS, PromptConfig
from peer.model.loading import bundled_path, load_tokenizer
from peer.model.prompts import PromptError, completion_text, cut_at_stop, end_token_ids, prompt_ids
from peer.model.sampling import decode, encode_prompts, sample_groups
from tests.helpers.models import random_lora

PROMPTS = ["1+2=", "123+456=", "55+5=", "999+1=", "0+0=", "12+34=", "7+70=", "450+50="]
# A template for the bundled character tokenizer: it knows digits, '+' and '=', so every turn renders to real tokens.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}+{% else %}"
    "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)
CHAT = PromptConfig(chat_template="auto", system_prompt="9")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(bundled_path()))


@pytest.fixture
def chat_tokenizer():
    t = load_tokenizer(str(bundled_path()))
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def model():
    from peer.model.adapter import attach_lora
    from peer.model.config import LoRAConfig, ModelConfig
    from peer.model.loading import load_base

    base = load_base(ModelConfig(name="bundled", quantization="none", device="cpu"))
    m = attach_lora(base.model, LoRAConfig())
    random_lora(m, seed=5)
    m.eval()
    return m


# ---------------------------------------------------------------------------------------------------- config


def test_prompt_config_defaults_are_todays_raw_prompts_and_round_trip():
    assert PromptConfig() == PromptConfig.from_dict({})
    assert (PromptConfig().chat_template, PromptConfig().system_prompt, PromptConfig().stop) == ("none", "", ())
    c = PromptConfig(chat_template="auto", system_prompt="Answer in <answer> tags.", stop=["</answer>", "\n\n"])
    assert c.stop == ("</answer>", "\n\n")  # a JSON list comes back as a tuple
    assert PromptConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"chat_template": "jinja"}, "chat_template must be one of"),
        ({"chat_template": None}, "chat_template must be one of"),
        ({"system_prompt": "x"}, "needs a chat template"),
        ({"chat_template": "auto", "system_prompt": 5}, "must be a string"),
        ({"chat_template": "auto", "system_prompt": "x" * (MAX_SYSTEM_PROMPT_CHARS + 1)}, "shorten it"),
        ({"stop": "</answer>"}, "list of strings"),
        ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "at most"),
        ({"stop": [""]}, "1 to 32 characters"),
        ({"stop": ["x" * 33]}, "1 to 32 characters"),
        ({"stop": [3]}, "1 to 32 characters"),
        ({"template": "auto"}, "no field"),
    ],
)
def test_prompt_config_refuses_what_a_strangers_manifest_may_send(fields, message):
    with pytest.raises(ValueError, match=message):
        PromptConfig.from_dict(fields)


# ---------------------------------------------------------------------------------------------------- rendering


def test_without_a_template_a_prompt_is_the_plain_tokenization(tokenizer):
    for text in PROMPTS:
        assert prompt_ids(tokenizer, PromptConfig(), text) == tokenizer(text)["input_ids"]
    ids, mask = encode_prompts(tokenizer, PROMPTS, torch.device("cpu"))
    plain = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=True)
    assert torch.equal(ids, plain["input_ids"]) and torch.equal(mask, plain["attention_mask"])


def test_chat_template_prompts_equal_apply_chat_template_exactly(chat_tokenizer):
    t = chat_tokenizer
    for text in PROMPTS:
        turns = [{"role": "system", "content": "9"}, {"role": "user", "content": text}]
        expected = t.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert prompt_ids(t, CHAT, text) == list(expected)
        rendered = t.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        assert rendered == f"<bos>9+{text}="
        assert t.convert_ids_to_tokens(prompt_ids(t, CHAT, text))[:3] == ["<bos>", "9", "+"]
    no_system = prompt_ids(t, PromptConfig(chat_template="auto"), "1+2")
    assert t.convert_ids_to_tokens(no_system) == ["<bos>", "1", "+", "2", "="]


def test_a_chat_template_the_tokenizer_lacks_is_one_clear_error(tokenizer):
    with pytest.raises(PromptError, match="has none; host the run with --chat-template none"):
        prompt_ids(tokenizer, PromptConfig(chat_template="auto"), "1+2=")


def test_end_tokens_are_the_generation_configs_and_the_tokenizers(tokenizer):
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2, 7]))
    assert end_token_ids(model, tokenizer) == (2, 7)
    assert end_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5)), tokenizer) == (2, 5)
    assert end_token_ids(SimpleNamespace(), tokenizer) == (tokenizer.eos_token_id,)


def test_completion_text_is_cut_before_the_first_stop_string(tokenizer):
    assert cut_at_stop("<answer>7</answer> more", ["</answer>", "more"]) == "<answer>7</answer>"
    assert cut_at_stop("<answer>7</answer>\n", ["</answer>"]) == "<answer>7</answer>"  # the last token's extra
    assert cut_at_stop("a long stop, b", ["a long stop", "g s"]) == "a long s"  # the one that completes first
    assert cut_at_stop("no stop here", ["</answer>"]) == "no stop here"
    ids = tokenizer("12+34=", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert completion_text(tokenizer, ids) == "12+34="
    assert completion_text(tokenizer, ids, ["+3", "4"]) == "12+3"


# ---------------------------------------------------------------------------------------------------- decoding


def _decode(model, tok, **options):
    tokenizer = tok
    ids, mask = encode_prompts(tokenizer, [p for p in PROMPTS for _ in range(4)], torch.device("cpu"))
    options = {"eos_id": tokenizer.eos_token_id, **options}
    return decode(model, ids, mask, max_new_tokens=8, pad_id=tokenizer.pad_token_id, **options)


def _rows(batch) -> list[list[int]]:
    return [
        [t for t, m in zip(r, k, strict=True) if m]
        for r, k in zip(batch.completion_ids.tolist(), batch.completion_mask.tolist(), strict=True)
    ]


def test_any_end_token_ends_a_row_and_is_the_last_one_kept(model, tokenizer):
    free = _decode(model, tokenizer, greedy=True)
    extra = next(t for row in _rows(free) for t in row[1:-1] if t != tokenizer.eos_token_id)  # a mid-row token
    cut = _decode(model, tokenizer, greedy=True, eos_id=(tokenizer.eos_token_id, extra))
    ends = {tokenizer.eos_token_id, extra}
    changed = 0
    for full, row in zip(_rows(free), _rows(cut), strict=True):
        first = next((i for i, t in enumerate(full) if t in ends), len(full) - 1)
        assert row == full[: first + 1]  # the same tokens, up to and including the first end token of any kind
        changed += len(row) < len(full)
    assert changed > 0
    assert (cut.completion_ids[~cut.completion_mask] == tokenizer.pad_token_id).all()


def test_a_stop_string_ends_a_row_after_the_token_that_completes_it(model, tokenizer):
    free = _decode(model, tokenizer, greedy=True)
    row0 = _rows(free)[0]
    stop = tokenizer.decode(row0[1:3], skip_special_tokens=True)  # completed by row 0's third token
    assert len(stop) == 2
    cut = _decode(model, tokenizer, greedy=True, stop=[stop], tokenizer=tokenizer)
    texts = cut.texts(tokenizer, [stop])
    for full, row, text in zip(_rows(free), _rows(cut), texts, strict=True):
        assert row == full[: len(row)]
        whole = tokenizer.decode(row, skip_special_tokens=True)
        if stop in whole:  # cut right after the token that completed it; the reward sees the text through it
            assert stop not in tokenizer.decode(row[:-1], skip_special_tokens=True)
            assert text == whole[: whole.index(stop) + len(stop)]
        else:
            assert row == full and text == whole
    assert _rows(cut)[0] == row0[:3]
    with pytest.raises(ValueError, match="tokenizer"):
        _decode(model, tokenizer, stop=["1"], tokenizer=None)


class _Recorder(torch.nn.Module):
    """The model, recording each forward's batch size and keyword arguments."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, []
        self.generation_config = model.generation_config

    def get_base_model(self):
        return self.inner.get_base_model()

    def forward(self, **kwargs):
        self.calls.append((kwargs["input_ids"].shape[0], sorted(kwargs)))
        return self.inner(**kwargs)


@pytest.mark.parametrize("greedy", [True, False])
def test_finished_rows_leave_the_batch_and_change_nobodys_tokens(model, tokenizer, greedy):
    """The loop before per-row stop kept every row in every forward (``compact=False``); dropping finished rows
    must give exactly the same tokens and masks, in fp32 on the bundled model with a LoRA adapter.

    The log-probs agree to float32 rounding, not always bit for bit: CPU BLAS computes a linear layer on fewer than
    4 rows with another kernel than on 4 or more (measured: ``F.linear(x[:k], W)`` differs from ``F.linear(x, W)[:k]``
    in the last bits for k < 4 only), so once fewer than 4 rows are left their log-probs can move by ~1e-6, as they
    would in any batch of a different size. Learners tolerate far more (mixed precision differs by ~0.1 nats)."""
    options = {"greedy": greedy, "temperature": 2.5, "generator": torch.Generator().manual_seed(3)}
    if greedy:  # greedy rows of a prompt are equal: digits as extra end tokens make prompts end at different steps
        options["eos_id"] = (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["1", "7"]))
    compact = _Recorder(model)
    fast = _decode(compact, tokenizer, **options)
    options["generator"] = torch.Generator().manual_seed(3)
    slow = _decode(model, tokenizer, compact=False, **options)
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.completion_mask, slow.completion_mask)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=0, atol=1e-5)
    lengths = fast.completion_mask.sum(1)
    assert lengths.min() < lengths.max(), "rows must end at different steps for this test to mean anything"
    sizes = [size for size, _ in compact.calls]
    alive = [int((lengths > step).sum()) for step in range(1, fast.completion_ids.shape[1])]
    assert sizes == [32, *alive], "each forward runs on the rows still decoding, and only those"
    assert "logits_to_keep" in compact.calls[0][1], "the prefill asks for the last position's logits only"


@pytest.mark.parametrize("copyable", [True, False])
def test_a_groups_prompt_is_computed_once_and_its_rows_sample_as_if_each_had_its_own(
    model, tokenizer, monkeypatch, copyable
):
    """``sample_groups`` runs the prefill on each distinct prompt and copies its KV-cache rows to the group's G
    rows: the tokens are those of decoding the G copies of every prompt (the loop before), the log-probs the same
    to float32 rounding. A cache whose rows cannot be copied gets every row's own prefill, as before."""
    import peer.model.sampling as sampling

    if not copyable:
        monkeypatch.setattr(sampling, "_repeat_rows", lambda cache, repeats: None)
    options = {"max_new_tokens": 8, "temperature": 1.5, "device": torch.device("cpu")}
    recorder = _Recorder(model)
    grouped = sample_groups(
        recorder, tokenizer, PROMPTS, group_size=4, generator=torch.Generator().manual_seed(7), **options
    )
    ids, mask = encode_prompts(tokenizer, [p for p in PROMPTS for _ in range(4)], torch.device("cpu"))
    each = decode(
        model,
        ids,
        mask,
        max_new_tokens=8,
        eos_id=end_token_ids(model, tokenizer),
        pad_id=tokenizer.pad_token_id,
        temperature=1.5,
        generator=torch.Generator().manual_seed(7),
    )
    assert torch.equal(grouped.prompt_ids, each.prompt_ids) and torch.equal(grouped.prompt_mask, each.prompt_mask)
    assert torch.equal(grouped.completion_ids, each.completion_ids)
    assert torch.equal(grouped.completion_mask, each.completion_mask)
    torch.testing.assert_close(grouped.logprobs, each.logprobs, rtol=0, atol=1e-5)
    assert len({tuple(r) for r in grouped.completion_ids.tolist()}) > len(PROMPTS), "a group's rows differ"
    prefills = [size for size, _ in recorder.calls[: 1 if copyable else 2]]
    assert prefills == ([8] if copyable else [8, 32]), "the prompt's forward runs once per group (else per row)"
    assert recorder.calls[1 if copyable else 2][0] <= 32
    with pytest.raises(ValueError, match="repeats"):
        decode(model, ids, mask, max_new_tokens=2, eos_id=2, pad_id=0, repeats=0)


def test_sampling_is_reproducible_from_its_seed_with_a_template_and_stops(model, chat_tokenizer):
    prompt = PromptConfig(chat_template="auto", system_prompt="9", stop=["00"])

    def run():
        return sample_groups(
            model,
            chat_tokenizer,
            PROMPTS[:4],
            group_size=4,
            max_new_tokens=8,
            temperature=1.5,
            device=torch.device("cpu"),
            generator=torch.Generator().manual_seed(11),
            prompt=prompt,
        )

    a, b = run(), run()
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    for row in range(16):
        rendered = prompt_ids(chat_tokenizer, prompt, PROMPTS[row // 4])
        assert a.prompt_ids[row][a.prompt_mask[row].bool()].tolist() == rendered
    assert all("00" not in t[:-2] for t in a.texts(chat_tokenizer, prompt.stop))


# ---------------------------------------------------------------------------------------------------- the run


@pytest.fixture
def template_model(tmp_path):
    folder = tmp_path / "tiny-chat"
    shutil.copytree(bundled_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def _manifest(folder, prompt):
    from coordinator.manifest import RunSettings, build_manifest

    return build_manifest(RunSettings(run_id="r", model=str(folder), prompt=prompt), folder, "0" * 64, "peer")


def test_the_manifest_carries_the_prompt_settings_only_when_set(template_model):
    from peer.run.spec import run_spec

    plain = _manifest(template_model, PromptConfig())
    assert "prompt" not in plain.grpo() and run_spec(plain, b"").prompt == PromptConfig()
    chat = PromptConfig(chat_template="auto", system_prompt="Think, then answer.", stop=("</answer>",))
    m = _manifest(template_model, chat)
    assert m.grpo()["prompt"] == {
        "chat_template": "auto",
        "system_prompt": "Think, then answer.",
        "stop": ["</answer>"],
    }
    assert run_spec(m, b"").prompt == chat


def test_a_host_cannot_publish_a_template_its_model_lacks_or_a_manifest_too_large(template_model):
    from coordinator.manifest import ManifestTooLarge

    with pytest.raises(PromptError, match="has none"):
        _manifest(bundled_path(), PromptConfig(chat_template="auto"))
    with pytest.raises(ManifestTooLarge, match="shorten --system-prompt"):
        _manifest(template_model, PromptConfig(chat_template="auto", system_prompt="\u00e9" * 1000))


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"chat_template": "always"}, "chat_template must be one of"),
        ({"stop": ["x"] * 9}, "at most"),
        ({"system_prompt": "y" * 5000, "chat_template": "auto"}, "shorten it"),
        ("auto", "expects a mapping"),
    ],
)
def test_a_peer_refuses_a_manifest_with_bad_prompt_settings(template_model, prompt, message):
    from peer.run.spec import ManifestError, run_spec

    m = _manifest(template_model, PromptConfig())
    bad = m.copy(update={"grpo_json": json.dumps({**m.grpo(), "prompt": prompt})})
    with pytest.raises(ManifestError, match=message):
        run_spec(bad, b"")


def test_the_learner_checks_prompt_tokens_against_the_chat_template(template_model, model, chat_tokenizer):
    from peer.roles.learner.verify import check_group
    from peer.roles.rollout.groups import build_groups
    from peer.run.spec import run_spec

    owner, sha = b"owner-key", "a" * 64
    spec = run_spec(_manifest(template_model, PromptConfig(chat_template="auto", system_prompt="9", stop=("0",))), b"")
    examples = [spec.example(owner, seq) for seq in (0, 1)]
    G = spec.sampling.group_size
    batch = sample_groups(
        model,
        chat_tokenizer,
        [e.prompt for e in examples],
        group_size=G,
        max_new_tokens=spec.sampling.max_new_tokens,
        temperature=1.0,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(0),
        prompt=spec.prompt,
    )
    texts = batch.texts(chat_tokenizer, spec.prompt.stop)  # as the rollout peer scores them
    rewards = [spec.task.reward(t, examples[i // G]) for i, t in enumerate(texts)]
    groups = build_groups(batch, rewards, range(2), spec, version=0, sha=sha, owner=owner, producer="p")

    def known(v):
        return sha if v == 0 else None

    assert [check_group(g, owner, spec, chat_tokenizer, known) for g in groups] == [None, None]
    from peer.protocol import encode_tokens

    raw = groups[0].copy(update={"prompt_ids": encode_tokens(chat_tokenizer(examples[0].prompt)["input_ids"])})
    refused = check_group(raw, owner, spec, chat_tokenizer, known)
    assert refused is not None and refused.reason == "prompt" and "rendered prompt" in refused


# ---------------------------------------------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_scores_the_tagged_answer_else_the_whole_completion():
    from peer.model.prompts import cut_at_stop as completion_text_of
    from peer.tasks import get_task
    from peer.tasks.gym import final_answer

    task = get_task("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1})
    ex = task.example(0, 0)
    right, wrong = ex.reference, str(int(ex.reference) + 1)
    assert task.reward(f"<answer>{right}</answer>", ex) == 1.0
    assert task.reward(f"Let me think: {ex.prompt} ... <answer> {right} </answer>\n", ex) == 1.0
    assert task.reward(f"<answer>{wrong}</answer> no, <answer>{right}</answer>", ex) == 1.0  # the last one
    assert task.reward(f"<answer>{wrong}</answer>", ex) == 0.0
    assert task.reward(f"  {right}\n", ex) == 1.0  # untagged: the whole completion, as before
    assert task.reward(f"{right} <answer>", ex) < 1.0  # an unclosed tag is not an answer
    assert final_answer(" <answer>\n42\n</answer> ") == "42" and final_answer(" 42 ") == "42"
    stopped = completion_text_of(f"<answer>{right}</answer>\n\nmore", ("</answer>",))
    assert stopped == f"<answer>{right}</answer>" and task.reward(stopped, ex) == 1.0  # --stop "</answer>" scores
