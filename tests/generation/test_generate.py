"""Generation: cached decoding equals the full forward, batching equals one prompt at a time,
sampling is seeded and filtered as documented (docs/contract.md §7, §11, §17).

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary.

The oracle is the model's own full forward over the whole sequence, without a cache: every cached
step must reproduce its logits at that position.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dikkat.generation import (
    decode_step,
    generate,
    inference_model,
    iter_generate,
    left_pad,
    prefill,
    sample,
)
from dikkat.models import GPT, GPTConfig
from dikkat.weights import InferenceLinear, w8a8_available
from helpers import scramble

V = 61  # a vocabulary that is not a power of two

VARIANTS = {
    "learned": dict(position="learned"),
    "rope": dict(position="rope"),
    "gqa": dict(position="learned", n_heads=4, n_kv_heads=2),
    "gqa-rope": dict(position="rope", n_heads=4, n_kv_heads=1),
    "untied-no-bias": dict(position="rope", tie_embeddings=False, bias=False),
}

W8A8 = pytest.param(
    "w8a8", marks=pytest.mark.skipif(not w8a8_available(), reason="needs FBGEMM (x86)")
)


def make_gpt(variant: str, seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    fields = dict(vocab_size=V, max_len=40, d_model=32, n_layers=2, n_heads=4)
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    return scramble(GPT(GPTConfig(**fields)), seed)


def random_ids(B: int, T: int, seed: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def argmax_loop(model: GPT, ids: Tensor, steps: int) -> Tensor:
    """Greedy decoding the slow way: the whole sequence through the model at every step."""
    for _ in range(steps):
        nxt = model(ids)[:, -1].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


# --- cached decoding equals the full forward -------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_decode_step_matches_the_full_forward(variant):
    model = make_gpt(variant, seed=1)
    B, T0, steps = 2, 5, 12
    seq = random_ids(B, T0 + steps, seed=2)  # the prompt and the tokens fed at each step
    with torch.no_grad():
        full = model(seq)  # (B, T0 + steps, V)
    cache = model.new_cache(B, T0 + steps)
    logits = prefill(model, seq[:, :T0], cache)
    torch.testing.assert_close(logits, full[:, T0 - 1], rtol=0, atol=1e-5)
    for t in range(T0, T0 + steps):
        logits = decode_step(model, seq[:, t], cache, t)
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-5)
        assert all(c.length == t + 1 for c in cache)
    # the comparison is not trivially true: logits move between positions by far more than 1e-5
    assert (full[:, 1:] - full[:, :-1]).abs().amax() > 0.1


@pytest.mark.parametrize("variant", ["learned", "rope", "gqa-rope"])
def test_left_padded_decode_steps_match_each_prompt_alone(variant):
    """Each row of a left-padded batch computes the logits of its own unpadded sequence."""
    model = make_gpt(variant, seed=3)
    lengths, steps = (3, 7, 1), 6
    seqs = [random_ids(1, n + steps, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids, valid = left_pad([s[:n].tolist() for s, n in zip(seqs, lengths, strict=True)])
    T = ids.shape[1]
    full_valid = torch.cat([valid, torch.ones(len(lengths), steps, dtype=torch.bool)], dim=1)
    cache = model.new_cache(len(lengths), T + steps)
    with torch.no_grad():
        alone = [model(s[None])[0] for s in seqs]  # (n + steps, V) each
    logits = prefill(model, ids, cache, full_valid)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(logits[b], alone[b][n - 1], rtol=0, atol=1e-5)
    for i in range(steps - 1):
        tokens = torch.stack([s[n + i] for s, n in zip(seqs, lengths, strict=True)])
        logits = decode_step(model, tokens, cache, T + i, full_valid)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(logits[b], alone[b][n + i], rtol=0, atol=1e-5)


# --- greedy generation -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["learned", "rope", "gqa"])
def test_greedy_generate_equals_an_uncached_argmax_loop(variant):
    model = make_gpt(variant, seed=4)
    ids = random_ids(3, 4, seed=5)
    out = model.generate(ids, 15)
    assert out == argmax_loop(model, ids, 15).tolist()  # each prompt, then its 15 new tokens
    assert model.generate(ids.tolist(), 15) == out  # a list of prompts gives the same lists


@pytest.mark.parametrize("variant", ["learned", "rope", "gqa-rope"])
def test_batched_prompts_of_different_lengths_equal_one_at_a_time(variant):
    model = make_gpt(variant, seed=6)
    prompts = [random_ids(1, n, seed=20 + n)[0].tolist() for n in (5, 1, 9, 3)]
    batched = model.generate(prompts, 10)
    alone = [model.generate([p], 10)[0] for p in prompts]
    assert batched == alone
    for p, row in zip(prompts, batched, strict=True):
        assert row[: len(p)] == p and len(row) == len(p) + 10
        # and alone, each equals the slow loop
        assert row == argmax_loop(model, torch.tensor([p]), 10)[0].tolist()


def test_generate_restores_training_mode():
    model = make_gpt("learned", seed=7).train()
    ids = random_ids(1, 3, seed=8)
    model.generate(ids, 4)
    assert model.training


def test_max_new_tokens_zero_returns_the_prompt():
    model = make_gpt("learned", seed=7)
    ids = random_ids(2, 3, seed=8)
    assert model.generate(ids, 0) == ids.tolist()
    assert model.generate([[1, 2], [3]], 0) == [[1, 2], [3]]


def test_generation_past_the_context_is_an_error():
    model = make_gpt("learned", seed=7, max_len=10)
    with pytest.raises(ValueError, match="context"):
        model.generate(random_ids(1, 6, seed=8), 5)


# --- eos -------------------------------------------------------------------------------------


def stop_at(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def test_eos_stops_a_row_and_fills_it_while_others_continue():
    model = make_gpt("learned", seed=9)
    ids = random_ids(2, 4, seed=10)
    steps = 12
    greedy = [row[4:] for row in model.generate(ids, steps)]
    # an eos that row 0 produces early and row 1 does not produce at all
    eos = next(t for t in greedy[0][1:6] if t not in greedy[1])
    out = model.generate(ids, steps, eos_id=eos)
    cut = [stop_at(r, eos) for r in greedy]
    assert len(cut[0]) < steps and cut[1] == greedy[1]
    assert out == [p + r for p, r in zip(ids.tolist(), cut, strict=True)]


def test_generation_stops_early_when_every_row_has_produced_eos():
    model = make_gpt("rope", seed=11)
    ids = random_ids(1, 4, seed=12)
    greedy = model.generate(ids, 12)[0][4:]
    eos = greedy[3]
    expected = stop_at(greedy, eos)
    assert len(expected) < 12
    steps = list(iter_generate(model, ids, 12, eos_id=eos))
    assert len(steps) == len(expected)  # the loop stopped once every row had produced eos
    # tensor and list prompts alike: the prompt, then the tokens cut after eos
    assert model.generate(ids, 12, eos_id=eos) == [ids[0].tolist() + expected]
    assert model.generate([ids[0].tolist()], 12, eos_id=eos) == [ids[0].tolist() + expected]


# --- sampling --------------------------------------------------------------------------------


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ():
    model = make_gpt("learned", seed=13)
    ids = random_ids(2, 3, seed=14)
    a = model.generate(ids, 20, temperature=1.0, seed=0)
    b = model.generate(ids, 20, temperature=1.0, seed=0)
    c = model.generate(ids, 20, temperature=1.0, seed=1)
    assert a == b
    assert a != c
    assert a != model.generate(ids, 20)  # sampling is not greedy here


def test_top_k_one_equals_greedy():
    model = make_gpt("gqa", seed=15)
    ids = random_ids(2, 4, seed=16)
    greedy = model.generate(ids, 12)
    for seed in (0, 1):
        assert model.generate(ids, 12, temperature=1.5, top_k=1, seed=seed) == greedy


def test_sample_greedy_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(17))
    assert torch.equal(sample(logits), logits.argmax(-1))


def top_p_set(probs: list[float], p: float) -> set[int]:
    """The smallest set of most probable tokens whose total probability reaches p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i]
        if total >= p:
            break
    return kept


# Probabilities listed out of order; p is chosen away from the cumulative sums (0.4, 0.65, 0.85,
# 0.95, 1) so float rounding cannot move the boundary.
PROBS = [0.05, 0.4, 0.1, 0.25, 0.2]


@pytest.mark.parametrize("p", [0.3, 0.5, 0.7, 0.9, 0.97, 1.0])
def test_top_p_samples_exactly_the_smallest_set_reaching_p(p):
    expected = top_p_set(PROBS, p)
    logits = torch.tensor(PROBS).log().expand(4000, -1)  # one row per draw
    g = torch.Generator().manual_seed(18)
    drawn = sample(logits, temperature=1.0, top_p=p, generator=g)
    assert set(drawn.tolist()) == expected
    # and within the kept set, tokens keep their relative probabilities
    mass = sum(PROBS[i] for i in expected)
    for i in expected:
        freq = (drawn == i).float().mean().item()
        assert abs(freq - PROBS[i] / mass) < 0.03


def test_top_k_samples_only_the_k_most_likely():
    logits = torch.tensor(PROBS).log().expand(4000, -1)
    g = torch.Generator().manual_seed(19)
    drawn = sample(logits, temperature=1.0, top_k=2, generator=g)
    assert set(drawn.tolist()) == {1, 3}  # the two largest probabilities, 0.4 and 0.25


# --- bad arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.5),
        dict(temperature=1.0, top_k=0),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=1.0, top_p=1.5),
        dict(top_k=0),  # invalid even where greedy decoding would not use it
        dict(top_p=0.0),
        dict(top_p=1.01),
    ],
)
def test_bad_sampling_arguments_raise(kwargs):
    model = make_gpt("learned", seed=20)
    with pytest.raises(ValueError):
        model.generate(random_ids(1, 3, seed=21), 4, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1.0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=2.0)],
)
def test_sample_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 4), **kwargs)


def test_negative_max_new_tokens_raises():
    model = make_gpt("learned", seed=20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(random_ids(1, 3, seed=21), -1)


@pytest.mark.parametrize(
    "prompts",
    [[[]], [[1, 2], []], [], torch.zeros(1, 0, dtype=torch.long)],
    ids=["one-empty", "one-of-two-empty", "no-prompts", "empty-tensor"],
)
def test_empty_prompts_raise(prompts):
    model = make_gpt("learned", seed=20)
    with pytest.raises(ValueError):
        model.generate(prompts, 3)


def test_float_prompt_tensor_raises():
    model = make_gpt("learned", seed=20)
    with pytest.raises(TypeError, match="prompts must be an integer tensor"):
        model.generate(torch.zeros(1, 3), 3)


# --- weight formats: bf16 and int8 ------------------------------------------------------------


@pytest.mark.parametrize("weights", ["bf16", "int8", W8A8])
def test_generate_in_a_smaller_format_stays_close_to_fp32_and_keeps_the_weights(weights):
    """The formats change the numbers (that is their point), so the assertion is a bound: the
    prefill's logits within 3 % of their range of the fp32 ones (and not equal to them), and the
    greedy tokens those of the same model's inference copy in that format decoding step by step;
    the model itself is left as it was."""
    model = make_gpt("learned").eval()
    ids = random_ids(2, 6, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = inference_model(model, weights)
    with torch.no_grad():
        exact = prefill(model, ids, model.new_cache(2, 6))
        low = prefill(copy, ids, copy.new_cache(2, 6))
        stepwise = argmax_loop(copy, ids, 5)
    err = float((low - exact).abs().max())
    assert 0 < err <= 0.03 * float(exact.max() - exact.min())
    out = model.generate(ids, 5, weights=weights)
    assert out == stepwise.tolist()
    assert generate(copy, ids, 5) == out  # a copy given is used as it is
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(isinstance(m, InferenceLinear) for m in model.modules())


def test_an_unknown_weight_format_is_refused_before_any_work():
    model = make_gpt("learned")
    refused = r"weights must be one of 'fp32', 'bf16', 'int8', 'w8a8', 'q8', 'q4', got 'q3'"
    with pytest.raises(ValueError, match=refused):
        iter_generate(model, [[1, 2]], 3, weights="q3")
    with pytest.raises(ValueError, match="got 'q3'"):
        model.generate([[1, 2]], 3, weights="q3")
