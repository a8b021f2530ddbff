"""SamplingParams, the one object every entry point decodes by: its checks, its keyword form,
what each entry point refuses, and the picks it makes (penalties and biases against an fp64
reference of OpenAI's definition, n choices per prompt)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dikkat.generation import (
    SamplingParams,
    generate,
    iter_generate,
    lookup_generate,
    token_logprobs,
)
from dikkat.generation.sampler import Sampler
from dikkat.generation.sampling import as_params
from dikkat.models import GPT, GPTConfig, Seq2Seq, Seq2SeqConfig
from helpers import scramble

V = 29


def make_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=V, max_len=40, d_model=32, n_layers=2, n_heads=4)
    return scramble(GPT(config), seed).eval()


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(stop_ids=(1, -2)), ValueError, r"stop_ids\[1\]"),
        (dict(stop=("",)), ValueError, "stop holds an empty string"),
        (dict(stop=(3,)), TypeError, "stop must be a tuple of strings"),
        (dict(n=0), ValueError, "n must be"),
        (dict(logprobs=1), TypeError, "logprobs"),
        (dict(top_logprobs=21, logprobs=True), ValueError, "top_logprobs"),
        (dict(top_logprobs=2), ValueError, "top_logprobs=2 needs logprobs=True"),
        (dict(frequency_penalty=2.5), ValueError, "frequency_penalty"),
        (dict(presence_penalty=-3), ValueError, "presence_penalty"),
        (dict(logit_bias={3: 101.0}), ValueError, r"logit_bias\[3\]"),
        (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias names -1"),
        (dict(logit_bias="3:1"), TypeError, "logit_bias must be a dict"),
        (dict(min_new_tokens=-1), ValueError, "min_new_tokens"),
        (dict(max_new_tokens=3, min_new_tokens=4), ValueError, "min_new_tokens=4 exceeds"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty"),
    ],
)
def test_bad_fields_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**kwargs)


def test_fields_are_normalised_and_the_object_stays_frozen_and_hashable():
    p = SamplingParams(stop="\n\n", stop_ids=[2], logit_bias={7: -1, 3: 2.5})
    assert p.stop == ("\n\n",) and p.stop_ids == (2,)
    assert p.logit_bias == ((3, 2.5), (7, -1.0))
    same = SamplingParams(stop=("\n\n",), stop_ids=(2,), logit_bias={3: 2.5, 7: -1})
    assert hash(p) == hash(same)
    with pytest.raises(AttributeError):
        p.n = 2  # type: ignore[misc]


def test_choices_are_single_choice_copies_seeded_one_apart():
    p = SamplingParams(n=3, seed=2**64 - 2, temperature=1.0)
    seeds = [c.seed for c in p.choices()]
    assert seeds == [2**64 - 2, 2**64 - 1, 0] and {c.n for c in p.choices()} == {1}
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]


def test_the_keyword_form_builds_the_same_params():
    assert as_params(5, dict(temperature=0.5, eos_id=3)) == SamplingParams(
        max_new_tokens=5, temperature=0.5, stop_ids=(3,)
    )
    assert as_params(5, dict(stop=["x", "y"])) == SamplingParams(max_new_tokens=5, stop=("x", "y"))
    with pytest.raises(TypeError, match="not both"):
        as_params(SamplingParams(), dict(temperature=0.5))
    with pytest.raises(TypeError, match="unknown sampling keyword 'temprature'"):
        as_params(5, dict(temprature=0.5))
    with pytest.raises(TypeError, match="SamplingParams or max_new_tokens"):
        as_params("5", {})


def test_generate_takes_params_or_keywords_alike():
    model = make_gpt()
    p = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=5, seed=3, stop_ids=(4,))
    assert generate(model, [[1, 2, 3]], p) == generate(
        model, [[1, 2, 3]], 6, temperature=0.9, top_k=5, seed=3, eos_id=4
    )
    assert model.generate([[1, 2, 3]], p) == generate(model, [[1, 2, 3]], p)


@pytest.mark.parametrize(
    ("field", "value"),
    [("stop", ("x",)), ("logprobs", True), ("prompt_logprobs", True)],
)
def test_token_level_entry_points_refuse_what_they_cannot_honour(field, value):
    model = make_gpt()
    p = SamplingParams(max_new_tokens=2, **{field: value})
    for call in (
        lambda: generate(model, [[1, 2]], p),
        lambda: iter_generate(model, [[1, 2]], p),
        lambda: lookup_generate(model, [[1, 2]], p),
    ):
        with pytest.raises(ValueError, match=f"cannot honour {field}="):
            call()


def test_seq2seq_and_lookup_refuse_choices_and_sampling():
    model = make_gpt()
    with pytest.raises(ValueError, match="lookup decoding cannot honour presence_penalty"):
        lookup_generate(model, [[1, 2]], SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="lookup decoding cannot honour min_new_tokens=2"):
        lookup_generate(model, [[1, 2]], SamplingParams(min_new_tokens=2, stop_ids=(3,)))
    torch.manual_seed(0)
    config = Seq2SeqConfig(src_vocab_size=V, tgt_vocab_size=V, d_model=16, n_heads=2,
                           n_encoder_layers=1, n_decoder_layers=1, max_len=16)  # fmt: skip
    s2s = Seq2Seq(config).eval()
    with pytest.raises(ValueError, match=r"Seq2Seq\.generate cannot honour n=2"):
        s2s.generate([[1, 2]], SamplingParams(n=2), bos_id=1)


def test_n_choices_are_rows_of_the_same_prompt():
    model = make_gpt()
    greedy = generate(model, [[1, 2], [3, 4, 5]], SamplingParams(max_new_tokens=5, n=2))
    assert len(greedy) == 4 and greedy[0] == greedy[1] and greedy[2] == greedy[3]
    assert greedy[0] == generate(model, [[1, 2]], 5)[0]
    p = SamplingParams(max_new_tokens=8, n=4, temperature=2.0, seed=0)
    sampled = generate(model, [[1, 2]], p)
    assert all(row[:2] == [1, 2] for row in sampled)
    assert len({tuple(row) for row in sampled}) > 1  # four draws from a flat distribution


def penalised_greedy(model: GPT, prompt: list[int], steps: int, p: SamplingParams) -> list[int]:
    """The greedy tokens under OpenAI's penalties and logit_bias, in fp64, each step a full
    forward of the whole text (no cache), the counts taken over the generated tokens."""
    model64 = make_gpt().double()
    model64.load_state_dict(model.state_dict())
    text, new = list(prompt), []
    for _ in range(steps):
        logits = model64(torch.tensor([text]))[0, -1]
        counts = torch.bincount(torch.tensor(new, dtype=torch.long), minlength=V).double()
        logits = logits - counts * p.frequency_penalty - (counts > 0).double() * p.presence_penalty
        for token, bias in p.logit_bias:
            logits[token] += bias
        new.append(int(logits.argmax()))
        text.append(new[-1])
    return new


@pytest.mark.parametrize(
    "fields",
    [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=0.7, presence_penalty=-0.5, logit_bias={5: 3.0, 6: -100.0}),
    ],
    ids=["frequency", "presence", "both-and-bias"],
)
def test_penalties_and_biases_follow_openais_definition(fields):
    model = make_gpt()
    p = SamplingParams(max_new_tokens=12, **fields)
    ours = generate(model, [[1, 2, 3]], p)[0][3:]
    assert ours == penalised_greedy(model, [1, 2, 3], 12, p)
    assert ours != generate(model, [[1, 2, 3]], 12)[0][3:]  # the penalties changed something


def test_a_large_bias_forces_its_token_and_a_banned_token_never_comes():
    model = make_gpt()
    forced = generate(model, [[1]], SamplingParams(max_new_tokens=5, logit_bias={9: 100}))
    assert forced[0][1:] == [9] * 5
    plain = generate(model, [[1]], 8)[0][1:]
    banned = generate(model, [[1]], SamplingParams(max_new_tokens=8, logit_bias={plain[0]: -100}))
    assert plain[0] not in banned[0][1:]


def test_no_stop_token_comes_before_min_new_tokens():
    """A stop token forced by a bias of +100 comes first at token min_new_tokens + 1 (vLLM's
    min_tokens): until then its logit is -inf, and the rest pick as without it."""
    model = make_gpt()
    forced = SamplingParams(max_new_tokens=6, logit_bias={9: 100}, stop_ids=(9,))
    assert generate(model, [[1]], forced)[0][1:] == [9]
    at_least = generate(model, [[1]], dataclasses.replace(forced, min_new_tokens=3))[0][1:]
    banned = generate(model, [[1]], SamplingParams(max_new_tokens=3, logit_bias={9: -100}))
    assert at_least == [*banned[0][1:], 9]
    sampled = dataclasses.replace(forced, min_new_tokens=4, temperature=1.5, seed=0)
    for row in generate(model, [[1]] * 3, sampled):  # rows of one batch: each makes 4 first
        assert 9 not in row[1:5] and row[5:] == [9]


def test_the_sampler_counts_each_rows_own_tokens():
    sampler = Sampler(SamplingParams(frequency_penalty=1.0))
    logits = torch.zeros(2, 4)
    logits[:, 2] = 0.5  # both rows pick 2 first; then row 0 must leave 2 (0.5 - 1 < 0)
    assert sampler.pick(logits).tolist() == [2, 2]
    assert sampler.pick(logits).tolist() == [0, 0]
    assert sampler.counts is not None and sampler.counts[:, 2].tolist() == [1.0, 1.0]


def repeat_penalised_greedy(model: GPT, prompt: list[int], steps: int, rp: float) -> list[int]:
    """The greedy tokens under a repetition penalty (Keskar et al. 2019, as HF applies it), in
    fp64, each step a full forward of the whole text: every token of the text so far, prompt
    included, has a positive logit divided by rp and a negative one multiplied."""
    model64 = make_gpt().double()
    model64.load_state_dict(model.state_dict())
    text = list(prompt)
    for _ in range(steps):
        logits = model64(torch.tensor([text]))[0, -1]
        seen = torch.zeros(V, dtype=torch.bool)
        seen[text] = True
        logits = torch.where(seen & (logits > 0), logits / rp, logits)
        logits = torch.where(seen & (logits < 0), logits * rp, logits)
        text.append(int(logits.argmax()))
    return text[len(prompt) :]


@pytest.mark.parametrize("rp", [1.3, 3.0, 0.5])
def test_the_repetition_penalty_counts_the_prompt_and_the_new_tokens(rp):
    model = make_gpt()
    p = SamplingParams(max_new_tokens=12, repetition_penalty=rp)
    prompts = [[1, 2, 3, 4, 5], [7, 7]]  # the second left-padded in the batch
    got = generate(model, prompts, p)
    for prompt, row in zip(prompts, got, strict=True):
        assert row[len(prompt) :] == repeat_penalised_greedy(model, prompt, 12, rp)
    assert got != generate(model, prompts, 12)  # the penalty changed something


def test_the_sampler_marks_no_pad_as_seen():
    sampler = Sampler(
        SamplingParams(repetition_penalty=2.0),
        torch.tensor([[0, 0, 3], [0, 2, 3]]),
        torch.tensor([[False, False, True], [True, True, True]]),
    )
    logits = torch.tensor([[1.0, 0.9, 0.0, 0.0], [1.0, 0.9, 0.0, 0.0]])
    assert sampler.pick(logits).tolist() == [0, 1]  # row 0's 0s are pads: not seen, picked
    assert sampler.seen is not None and sampler.seen.tolist() == [
        [True, False, False, True], [True, True, True, True]]  # fmt: skip


def test_token_logprobs_are_the_fp32_log_softmax_with_the_top_alternatives():
    logits = torch.randn(3, 11, dtype=torch.float64)
    tokens = torch.tensor([0, 5, 10])
    out = token_logprobs(logits, tokens, top=3)
    exact = torch.log_softmax(logits, dim=-1)
    for r, item in enumerate(out):
        assert item.token == tokens[r]
        assert abs(item.logprob - exact[r, tokens[r]].item()) < 1e-6
        ids = exact[r].argsort(descending=True)[:3].tolist()
        assert [t for t, _ in item.top] == ids
        assert all(abs(lp - exact[r, t].item()) < 1e-6 for t, lp in item.top)
