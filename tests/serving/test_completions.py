"""``/v1/completions`` beyond one prompt and one choice, on a tiny GPT: many prompts (strings,
token-id lists), ``n`` and ``best_of``, ``echo``, and ``logprobs`` in OpenAI's completions
format, checked against the model's own ``log_softmax`` in fp64 — and the request
lm-evaluation-harness's ``local-completions`` sends."""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from live_server import WAIT, request, serving, settled  # noqa: E402

from dikkat.generation import SamplingParams, generate  # noqa: E402
from dikkat.serving import Engine, create_app  # noqa: E402
from dikkat.text import ByteTokenizer  # noqa: E402

NAME = "tiny"
BYTES = ByteTokenizer()


def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


def new_ids(model: Any, prompt: list[int], n: int, **sampling: Any) -> list[int]:
    out = generate(model, [prompt], SamplingParams(max_new_tokens=n, **sampling))
    return out[0][len(prompt) :]


def log_softmax(model: Any, ids: list[int]) -> torch.Tensor:
    """(T, V) fp64 log-probabilities: row t is the model's distribution after ids[: t + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


@pytest.fixture(scope="module")
def url(tiny_gpt):
    with serving(create_app(Engine(tiny_gpt, max_batch=8), BYTES, NAME)) as base:
        yield base


def test_many_prompts_get_their_choices_prompt_major(url, tiny_gpt):
    texts = ["ab", "héllo", "xyz!"]
    r = client(url).completions.create(
        model=NAME, prompt=texts, max_tokens=5, temperature=1.0, seed=11, n=2
    )
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        p, j = divmod(c.index, 2)
        ids = new_ids(tiny_gpt, BYTES.encode(texts[p]), 5, temperature=1.0, seed=11 + j)
        assert c.text == BYTES.decode(ids)
    assert r.usage.prompt_tokens == sum(len(BYTES.encode(t)) for t in texts)  # once per prompt
    assert r.usage.completion_tokens == 6 * 5
    as_ids = [BYTES.encode(t) for t in texts]  # the same prompts as token-id lists
    again = client(url).completions.create(
        model=NAME, prompt=as_ids, max_tokens=5, temperature=1.0, seed=11, n=2
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    settled(url)


def test_logprobs_are_the_completions_format_of_the_model_s_log_softmax(url, tiny_gpt):
    prompt = BYTES.encode("héllo")
    r = client(url).completions.create(
        model=NAME, prompt="héllo", max_tokens=6, temperature=0, logprobs=2
    )
    ids = new_ids(tiny_gpt, prompt, 6)
    reference = log_softmax(tiny_gpt, prompt + ids)[len(prompt) - 1 : -1]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for k, token in enumerate(ids):
        assert abs(lp.token_logprobs[k] - reference[k, token].item()) < 1e-4
        assert 1 <= len(lp.top_logprobs[k]) <= 3  # the 2 most likely and the chosen one
        assert max(lp.top_logprobs[k].values()) == pytest.approx(lp.token_logprobs[k])  # greedy
    # offsets count from the prompt's start, each where its token's text begins
    assert lp.text_offset[0] == len("héllo")
    assert all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))


def test_echo_with_logprobs_scores_the_prompt_teacher_forced(url, tiny_gpt):
    text = "a wörd"
    prompt = BYTES.encode(text)
    reference = log_softmax(tiny_gpt, prompt)
    for max_tokens in (0, 1):
        r = client(url).completions.create(
            model=NAME, prompt=text, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        c = r.choices[0]
        assert c.text.startswith(text) and len(c.logprobs.tokens) == len(prompt) + max_tokens
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        for k in range(1, len(prompt)):
            expected = reference[k - 1, prompt[k]].item()
            assert abs(c.logprobs.token_logprobs[k] - expected) < 1e-4
        # ö is 2 tokens and 1 character: the second begins where the first does
        assert c.logprobs.text_offset[: len(prompt)] == [0, 1, 2, 3, 3, 4, 5]
        assert r.usage.completion_tokens == max_tokens
    assert c.logprobs.token_logprobs[-1] == pytest.approx(reference[-1].max().item(), abs=1e-4)
    # no logprobs: the text only
    r = client(url).completions.create(model=NAME, prompt=text, max_tokens=0, echo=True)
    assert (r.choices[0].text, r.choices[0].logprobs) == (text, None)


def test_lm_evaluation_harness_s_loglikelihood_request(url, tiny_gpt):
    """``local-completions`` sends batches of token-id lists with ``echo, logprobs: 1,
    max_tokens: 1, temperature: 0`` and reads ``token_logprobs[ctxlen:-1]`` and whether each
    equals the best of its ``top_logprobs``."""
    contexts = [BYTES.encode("Paris is in"), BYTES.encode("2 + 2 =")]
    continuations = [BYTES.encode(" France"), BYTES.encode(" 4")]
    prompts = [c + x for c, x in zip(contexts, continuations, strict=True)]
    body = dict(model=NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0,
                seed=1234)  # fmt: skip
    status, answer = request(url, "POST", "/v1/completions", body)
    assert status == 200, answer
    for choice, context, ids in zip(
        sorted(answer["choices"], key=lambda c: c["index"]), contexts, prompts, strict=True
    ):
        reference = log_softmax(tiny_gpt, ids)
        got = choice["logprobs"]["token_logprobs"][len(context) : -1]
        expected = [reference[k - 1, ids[k]].item() for k in range(len(context), len(ids))]
        assert got == pytest.approx(expected, abs=1e-4)
        tops = choice["logprobs"]["top_logprobs"][len(context) : -1]
        greedy = [reference[k - 1].argmax().item() == ids[k] for k in range(len(context), len(ids))]
        assert [lp == max(top.values()) for lp, top in zip(got, tops, strict=True)] == greedy


def test_best_of_keeps_the_n_with_the_highest_mean_logprob(url, tiny_gpt):
    prompt = BYTES.encode("ab")
    args = dict(model=NAME, prompt="ab", max_tokens=6, temperature=1.0, seed=5)
    r = client(url).completions.create(best_of=4, n=2, logprobs=0, **args)
    assert [c.index for c in r.choices] == [0, 1]
    candidates = []
    for j in range(4):
        ids = new_ids(tiny_gpt, prompt, 6, temperature=1.0, seed=5 + j)
        reference = log_softmax(tiny_gpt, prompt + ids)[len(prompt) - 1 : -1]
        mean = sum(reference[k, t].item() for k, t in enumerate(ids)) / len(ids)
        candidates.append((mean, BYTES.decode(ids)))
    best = [text for _, text in sorted(candidates, reverse=True)[:2]]
    assert [c.text for c in r.choices] == best
    assert r.usage.completion_tokens == 4 * 6  # every candidate was generated
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(best_of=4, n=2, stream=True, **args)
    assert e.value.body["param"] == "best_of"


def test_streamed_echo_and_logprobs_join_to_the_whole_answer(url):
    args = dict(model=NAME, prompt=["ab", "cd"], max_tokens=5, temperature=1.0, seed=2,
                echo=True, logprobs=1)  # fmt: skip
    whole = client(url).completions.create(**args)
    texts, tokens = ["", ""], [[], []]
    for chunk in client(url).completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.logprobs.tokens for c in whole.choices]
