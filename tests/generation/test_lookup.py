"""Prompt-lookup decoding: the tokens of plain greedy ``generate``, token for token, in fewer model
calls; the n-gram guesses are the latest earlier occurrence's; bad arguments are refused.

Notation: ``T`` prompt length, ``k`` guessed tokens, ``V`` vocabulary.

The oracle is :func:`dikkat.generation.generate` at temperature 0, one token per model call. The
scrambled tiny models fall into loops, so many guesses are accepted and some rejected: both paths
of the check (and the rejected guesses' cache slots) are exercised, which the tests assert.
"""

from __future__ import annotations

import pytest
import torch

from dikkat.generation import (
    LookupStats,
    NgramIndex,
    generate,
    iter_lookup_generate,
    lookup_generate,
)
from dikkat.layers import KVCache
from dikkat.models import GPT, GPTConfig
from dikkat.weights import InferenceLinear
from helpers import scramble

V = 61  # a vocabulary that is not a power of two

CONFIGS = {
    "learned": dict(position="learned"),
    "rope-gqa": dict(position="rope", n_kv_heads=2),
}

PROMPTS = {
    "repetitive": [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    "one-token": [5],
    "plain": [7, 3, 9, 2, 11, 0, 40, 33],
}


def make_gpt(config: str, seed: int = 0, max_len: int = 48) -> GPT:
    torch.manual_seed(seed)
    fields = dict(vocab_size=V, max_len=max_len, d_model=32, n_layers=2, n_heads=4)
    return scramble(GPT(GPTConfig(**fields, **CONFIGS[config])), seed)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> GPT:
    return make_gpt(request.param)


# --- the tokens of plain greedy decoding ---------------------------------------------------------


def test_lookup_gives_the_greedy_tokens_for_every_prompt_and_k(model: GPT) -> None:
    total = LookupStats()
    for prompt in PROMPTS.values():
        expected = generate(model, [prompt], 30)
        for k in (1, 2, 4, 8):
            stats = LookupStats()
            assert lookup_generate(model, [prompt], 30, k=k, stats=stats) == expected, (prompt, k)
            assert stats.tokens == 30
            assert stats.calls == 1 + (stats.tokens - 1) - stats.accepted  # each call: 1 + accepted
            total.drafted += stats.drafted
            total.accepted += stats.accepted
    # both paths ran: guesses kept (fewer calls than tokens) and guesses thrown away
    assert 0 < total.accepted < total.drafted


@pytest.mark.parametrize("ngram", [1, 2, 5])
def test_every_ngram_length_gives_the_greedy_tokens(model: GPT, ngram: int) -> None:
    prompt = PROMPTS["plain"]
    assert lookup_generate(model, [prompt], 25, k=4, ngram=ngram) == generate(model, [prompt], 25)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 38])
def test_it_stops_after_max_new_tokens_as_generate_does(model: GPT, n: int) -> None:
    # 10 + 38 = the whole context: the last check may not guess past the cache's last slot
    prompt = PROMPTS["repetitive"]
    for k in (2, 8):
        assert lookup_generate(model, [prompt], n, k=k) == generate(model, [prompt], n)


def test_it_stops_at_eos_where_generate_stops(model: GPT) -> None:
    prompt = PROMPTS["repetitive"]
    plain = generate(model, [prompt], 30)[0][len(prompt) :]
    stopped = 0
    for eos_id in dict.fromkeys(plain):  # each new token once, in order of first appearance
        expected = generate(model, [prompt], 30, eos_id=eos_id)
        for k in (1, 4, 8):
            out = lookup_generate(model, [prompt], 30, k=k, eos_id=eos_id)
            assert out == expected, (eos_id, k)
        stopped += len(expected[0]) < len(prompt) + 30
    assert stopped  # some eos fell before max_new_tokens


def test_a_tensor_prompt_and_the_streamed_tokens(model: GPT) -> None:
    prompt = torch.tensor([PROMPTS["plain"]])
    tokens = list(iter_lookup_generate(model, prompt, 12, k=4))
    assert all(t.shape == (1,) for t in tokens)
    expected = generate(model, prompt, 12)[0][prompt.shape[1] :]
    assert [int(t) for t in tokens] == expected
    assert lookup_generate(model, prompt, 12, k=4) == generate(model, prompt, 12)


def test_the_weights_format_reaches_every_linear_layer(model: GPT, monkeypatch) -> None:
    seen = []
    forward = InferenceLinear.forward
    monkeypatch.setattr(
        InferenceLinear, "forward", lambda m, x: seen.append(m.weights_format) or forward(m, x)
    )
    prompt = PROMPTS["repetitive"]
    out = lookup_generate(model, [prompt], 12, k=4, weights="int8")
    monkeypatch.undo()
    assert seen and set(seen) == {"int8"}
    assert out == generate(model, [prompt], 12, weights="int8")


def test_the_stats_add_up_over_calls() -> None:
    model = make_gpt("learned")
    stats = LookupStats()
    assert stats.acceptance == 0.0 and stats.tokens_per_call == 0.0
    lookup_generate(model, [PROMPTS["repetitive"]], 20, k=4, stats=stats)
    first = LookupStats(**vars(stats))
    lookup_generate(model, [PROMPTS["repetitive"]], 20, k=4, stats=stats)
    assert vars(stats) == {name: 2 * value for name, value in vars(first).items()}
    assert stats.acceptance == first.accepted / first.drafted
    assert stats.tokens_per_call == 40 / (2 * first.calls) > 1


def test_rejected_slots_are_overwritten_and_not_attended() -> None:
    # what the lookup relies on: a write at an earlier slot cuts the filled length there
    cache = KVCache(batch=1, n_kv_heads=1, max_len=8, head_dim=2)
    cache.update(0, torch.ones(1, 1, 5, 2), torch.ones(1, 1, 5, 2))  # token + 4 guesses
    k, v = cache.update(2, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))  # 1 kept
    assert k.shape[2] == v.shape[2] == cache.length == 4
    for t in (k, v):
        assert t[0, 0, :2].eq(1).all() and t[0, 0, 2:].eq(0).all()


# --- the n-gram guesses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "ngram", "k", "draft"),
    [
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, [8]),  # the latest occurrence, not the first
        ([3, 1, 2, 9, 4, 1, 2, 8, 3, 1, 2], 3, 2, [9, 4]),  # the longest n that matched
        ([5, 6, 7, 1, 2, 3], 3, 2, []),  # 3, 2 and 1 never occurred before: no guess
        ([5, 6, 7, 6], 3, 3, [7, 6, 7]),  # n = 1 at the end; the copy reads into itself
        ([4, 4, 4], 2, 4, [4, 4, 4, 4]),  # overlapping occurrences
        ([1, 2, 3, 1, 2], 2, 0, []),
    ],
)
def test_ngram_index_drafts(tokens: list[int], ngram: int, k: int, draft: list[int]) -> None:
    assert NgramIndex(ngram, tokens).draft(k) == draft


def test_ngram_index_grows_with_append() -> None:
    index = NgramIndex(2, [1, 2, 3])
    assert index.draft(2) == []
    index.append(1)
    assert index.draft(2) == [2, 3]
    index.append(7)
    assert index.draft(2) == []  # [1, 7] and 7 are new


# --- bad arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(k=0), ValueError, "k must be"),
        (dict(ngram=0), ValueError, "ngram must be"),
        (dict(k=2.5), TypeError, "k must be"),
        (dict(prompts=[[1, 2], [3, 4]]), ValueError, "one prompt (batch 1), got 2"),
        (dict(prompts=torch.zeros(3, 2, dtype=torch.long)), ValueError, "batch 1"),
        (dict(eos_id=V), ValueError, "eos_id"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=100), ValueError, "past the model's context of 48"),
        (dict(weights="fp8"), ValueError, "weights"),
        (dict(stats={}), TypeError, "stats must be a LookupStats"),
        (dict(temperature=0.8), ValueError, "temperature=0.8: it decodes greedily"),
    ],
)
def test_bad_arguments_are_refused_at_the_call(kwargs, error, message) -> None:
    model = make_gpt("learned")
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    prompts, n = args.pop("prompts"), args.pop("max_new_tokens")
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        iter_lookup_generate(model, prompts, n, **args)  # checked before the first next()
