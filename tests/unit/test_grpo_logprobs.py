"""Per-token log-probs: the formula, the completion mask, and agreement with what generate() recorded."""

import contextlib

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from peer.grpo import completion_logprobs, completion_mask, sequence_logprobs, token_logprobs

torch.set_num_threads(1)

PAD, EOS = 0, 1
VOCAB = 16


def _tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    # A wide init makes the tiny model's distributions far from uniform, so mismatches show.
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=PAD,
            eos_token_id=EOS,
            initializer_range=0.2,
        )
        return LlamaForCausalLM(config).eval()
    # Learned absolute positions: the model where wrong position ids cannot hide.
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        initializer_range=0.2,
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return _tiny(request.param)


@pytest.fixture(scope="module")
def gpt2():
    return _tiny("gpt2")


def _left_padded_prompts(lengths, width):
    generator = torch.Generator().manual_seed(1)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(2, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def _sample(model, prompt_ids, prompt_mask, temperature, max_new_tokens=8):
    torch.manual_seed(2)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=True,
        output_logits=True,
        return_dict_in_generate=True,
        top_k=0,
        top_p=1.0,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    completion = out.sequences[:, prompt_ids.shape[1] :]
    recorded = token_logprobs(torch.stack(out.logits, dim=1), completion, temperature)
    return completion, recorded


def test_token_logprobs_matches_naive_log_softmax():
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 4
    tokens = torch.randint(0, 11, (3, 5))
    got = token_logprobs(logits, tokens, temperature=0.7)
    naive = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    torch.testing.assert_close(got, naive)


def test_token_logprobs_of_bf16_logits_is_float32_and_differentiable():
    logits = torch.randn(2, 4, 7).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 7, (2, 4))
    out = token_logprobs(logits, tokens, temperature=1.0)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="must agree on leading dims"):
        token_logprobs(torch.randn(1, 2, 3), torch.zeros(1, 3, dtype=torch.long), temperature=1.0)
    with pytest.raises(ValueError, match="integer tensor"):
        token_logprobs(torch.randn(1, 2, 3), torch.zeros(1, 2), temperature=1.0)


def test_completion_mask_eos_middle_end_never():
    ids = torch.tensor(
        [
            [5, EOS, PAD, PAD],  # eos in the middle: it counts, the padding after it does not
            [5, 6, 7, EOS],  # eos at the end
            [5, 6, 7, 8],  # cut at max_new_tokens
            [EOS, EOS, 3, EOS],  # only the first eos ends the completion
        ]
    )
    assert completion_mask(ids, EOS).tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, True, True, True],
        [True, False, False, False],
    ]


def test_completion_mask_several_eos_ids():
    ids = torch.tensor([[4, 9, 5, EOS], [4, EOS, 9, 5]])
    assert completion_mask(ids, [EOS, 9]).tolist() == [[True, True, False, False], [True, True, False, False]]
    with pytest.raises(ValueError, match="at least one token id"):
        completion_mask(ids, [])
    with pytest.raises(ValueError, match=r"shape \[B, C\]"):
        completion_mask(ids[0], EOS)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_reproduce_generate_on_left_padded_prompts(model, temperature):
    prompt_ids, prompt_mask = _left_padded_prompts([3, 5, 7, 2], width=7)
    completion, recorded = _sample(model, prompt_ids, prompt_mask, temperature)
    mask = completion_mask(completion, EOS)
    assert mask.sum() > completion.shape[0]  # the comparison covers more than first tokens
    with torch.no_grad():
        full = completion_logprobs(model, prompt_ids, prompt_mask, completion, temperature)
        kept = completion_logprobs(model, prompt_ids, prompt_mask, completion, temperature, logits_to_keep=True)
    assert full.shape == completion.shape and full.dtype == torch.float32
    assert (full - recorded)[mask].abs().max() < 1e-4
    assert (kept - recorded)[mask].abs().max() < 1e-4


def test_without_generate_position_ids_absolute_positions_disagree(gpt2):
    # The check above is only meaningful if a wrong layout fails it: with default positions 0..L-1 the padded
    # rows of a learned-position model drift far beyond the tolerance.
    prompt_ids, prompt_mask = _left_padded_prompts([3, 7], width=7)
    completion, recorded = _sample(gpt2, prompt_ids, prompt_mask, 1.0)
    mask = completion_mask(completion, EOS)
    with torch.no_grad():
        logits = gpt2(
            input_ids=torch.cat([prompt_ids, completion], 1),
            attention_mask=torch.cat([prompt_mask, torch.ones_like(completion)], 1),
        ).logits
    naive = token_logprobs(logits[:, prompt_ids.shape[1] - 1 : -1], completion, 1.0)
    assert (naive - recorded)[0][mask[0]].abs().max() > 1e-2  # padded row
    assert (naive - recorded)[1][mask[1]].abs().max() < 1e-4  # unpadded row


def test_completion_logprobs_flow_gradient_into_the_model(gpt2):
    prompt_ids, prompt_mask = _left_padded_prompts([2, 4], width=4)
    completion = torch.tensor([[3, 4, EOS], [5, EOS, PAD]])
    gpt2.zero_grad()
    logprobs = completion_logprobs(gpt2, prompt_ids, prompt_mask, completion, 1.0)
    logprobs[completion_mask(completion, EOS)].sum().backward()
    grads = [p.grad for p in gpt2.parameters() if p.grad is not None]
    gpt2.zero_grad()
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_sequence_logprobs_agree_with_completion_layout(gpt2):
    prompt_ids, prompt_mask = _left_padded_prompts([2, 4], width=4)
    completion = torch.tensor([[3, 4, EOS], [5, 6, 7]])
    with torch.no_grad():
        per_completion = completion_logprobs(gpt2, prompt_ids, prompt_mask, completion, 0.9)
        ids = torch.cat([prompt_ids, completion], 1)
        per_sequence = sequence_logprobs(gpt2, ids, torch.cat([prompt_mask, torch.ones_like(completion)], 1), 0.9)
    assert per_sequence.shape == (2, ids.shape[1] - 1)
    torch.testing.assert_close(per_sequence[:, prompt_ids.shape[1] - 1 :], per_completion)


def test_completion_logprobs_layout_errors(gpt2):
    prompt_ids, prompt_mask = _left_padded_prompts([2, 4], width=4)
    completion = torch.tensor([[3, 4], [5, 6]])
    right_padded = prompt_mask.flip(-1)
    with pytest.raises(ValueError, match="left-padded"):
        completion_logprobs(gpt2, prompt_ids, right_padded, completion, 1.0)
    holes = prompt_mask.clone()
    holes[1, 1] = 0
    with pytest.raises(ValueError, match="left-padded"):
        completion_logprobs(gpt2, prompt_ids, holes, completion, 1.0)
    with pytest.raises(ValueError, match="B = 2 as in prompt_ids"):
        completion_logprobs(gpt2, prompt_ids, prompt_mask, completion[:1], 1.0)
    with pytest.raises(ValueError, match=r"prompt_ids and prompt_mask must both have shape \[B, P\]"):
        completion_logprobs(gpt2, prompt_ids, prompt_mask[:, 1:], completion, 1.0)
    with pytest.raises(ValueError, match="at least one position"):
        completion_logprobs(gpt2, prompt_ids, prompt_mask, completion[:, :0], 1.0)


def _groups(runs, completion_len=5):
    """Prompts in runs of equal rows (a GRPO group's completions side by side, runs of ``runs[i]`` rows, prompts of
    different lengths, left-padded), and random completions."""
    lengths = [2 + (i * 3) % 5 for i in range(len(runs))]
    distinct_ids, distinct_mask = _left_padded_prompts(lengths, width=max(lengths))
    index = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs))
    generator = torch.Generator().manual_seed(5)
    completion = torch.randint(2, VOCAB, (int(index.numel()), completion_len), generator=generator)
    if completion_len == 5:
        completion[0, 3:] = torch.tensor([EOS, PAD])  # a row that ended early, padded after its eos
    return distinct_ids[index], distinct_mask[index], completion


@contextlib.contextmanager
def _forward_positions(model):
    """The positions each forward of ``model`` computes (rows x tokens) while inside, as a list."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.parametrize("runs", [[8, 8, 8], [3, 1, 8, 2], [1, 1]])
def test_rows_that_share_a_prompt_compute_it_once_with_the_same_logprobs_and_gradients(model, runs):
    prompt_ids, prompt_mask, completion = _groups(runs)
    out = {}
    for share in (False, True):
        model.zero_grad()
        with _forward_positions(model) as seen:
            logprobs = completion_logprobs(model, prompt_ids, prompt_mask, completion, 0.9, share_prompts=share)
        (logprobs * torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out[share] = logprobs.detach(), grads, seen
    (plain, plain_grads, plain_seen), (shared, shared_grads, shared_seen) = out[False], out[True]
    rows, P, C = completion.shape[0], prompt_ids.shape[1], completion.shape[1]
    assert plain_seen == [rows * (P + C)]
    torch.testing.assert_close(shared, plain, rtol=0, atol=2e-5)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if len(runs) == rows:  # no two rows share a prompt: every row's own forward, as without sharing
        assert shared_seen == plain_seen
    else:  # each prompt once, then the rows' completions but their last token on its copied cache
        assert shared_seen == [len(runs) * P, rows * (C - 1)]
    model.zero_grad()


def test_sharing_prompts_with_one_completion_token_needs_the_prompts_forward_only(model):
    prompt_ids, prompt_mask, completion = _groups([4, 4], completion_len=1)
    with _forward_positions(model) as seen, torch.no_grad():
        shared = completion_logprobs(model, prompt_ids, prompt_mask, completion, 1.0, share_prompts=True)
    with torch.no_grad():
        plain = completion_logprobs(model, prompt_ids, prompt_mask, completion, 1.0)
    assert seen == [2 * prompt_ids.shape[1]]
    torch.testing.assert_close(shared, plain, rtol=0, atol=2e-5)


def test_a_cache_whose_rows_cannot_be_copied_gets_every_rows_own_forward(model, monkeypatch):
    from peer.grpo import logprobs as module

    def refuse(cache, index):
        raise TypeError(f"cannot select rows of a KV cache of type {type(cache).__name__}")

    monkeypatch.setattr(module, "select_cache_rows", refuse)
    prompt_ids, prompt_mask, completion = _groups([4, 4])
    with _forward_positions(model) as seen, torch.no_grad():
        shared = completion_logprobs(model, prompt_ids, prompt_mask, completion, 1.0, share_prompts=True)
    with torch.no_grad():
        plain = completion_logprobs(model, prompt_ids, prompt_mask, completion, 1.0)
    rows, P, C = completion.shape[0], prompt_ids.shape[1], completion.shape[1]
    assert seen == [2 * P, rows * (P + C)], "the prompts' forward, then every row's own"
    torch.testing.assert_close(shared, plain, rtol=0, atol=0)
