"""``/v1/chat/completions``, ``/tokenize`` and ``/detokenize`` on a tiny GPT with a small chat
template, through the official ``openai`` client: the answer is the engine's tokens for the
rendered conversation, streamed or whole, ``n`` choices seeded ``seed + i``, logprobs in
OpenAI's chat format."""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from live_server import WAIT, request, serving, settled  # noqa: E402

from conftest import chatml, chatml_ids  # noqa: E402
from dikkat.generation import SamplingParams, generate  # noqa: E402
from dikkat.serving import Engine, create_app  # noqa: E402
from dikkat.text import ByteTokenizer  # noqa: E402

NAME = "tiny"
BYTES = ByteTokenizer()
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]


def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


def answer_ids(model: Any, messages: list[dict], n: int, **sampling: Any) -> list[int]:
    prompt = BYTES.encode(chatml(messages))
    params = SamplingParams(max_new_tokens=n, **sampling)
    return generate(model, [prompt], params)[0][len(prompt) :]


@pytest.fixture(scope="module")
def url(tiny_gpt):
    app = create_app(Engine(tiny_gpt, max_batch=4), BYTES, NAME, chat_ids=chatml_ids)
    with serving(app) as base:
        yield base


def test_a_greedy_answer_is_the_engine_s_for_the_rendered_conversation(url, tiny_gpt):
    expected = BYTES.decode(answer_ids(tiny_gpt, MESSAGES, 12, temperature=0.0))
    r = client(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.model == NAME
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length" and choice.logprobs is None
    prompt_len = len(BYTES.encode(chatml(MESSAGES)))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, 12)


def test_a_streamed_answer_says_the_role_then_the_text_then_usage(url, tiny_gpt):
    expected = BYTES.decode(answer_ids(tiny_gpt, MESSAGES, 10, temperature=0.0))
    chunks = list(
        client(url).chat.completions.create(
            model=NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *parts, last = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parts) == expected
    assert [c.choices[0].finish_reason for c in parts][-1] == "length"
    assert last.choices == [] and last.usage.completion_tokens == 10


def test_n_choices_are_seeded_seed_plus_i_and_repeat(url, tiny_gpt):
    args = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7)
    r = client(url).chat.completions.create(n=3, **args)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2]
    expected = [BYTES.decode(answer_ids(tiny_gpt, MESSAGES, 8, temperature=1.0, seed=7 + i))
                for i in range(3)]  # fmt: skip
    assert texts == expected and len(set(texts)) > 1
    assert [c.message.content for c in client(url).chat.completions.create(n=3, **args).choices] \
        == texts  # fmt: skip
    assert client(url).chat.completions.create(n=1, **args).choices[0].message.content == texts[0]
    assert r.usage.completion_tokens == 3 * 8
    # streamed: each choice's chunks carry its index, and join to its text
    joined = ["", "", ""]
    for chunk in client(url).chat.completions.create(n=3, stream=True, **args):
        for c in chunk.choices:
            joined[c.index] += c.delta.content or ""
    assert joined == texts
    settled(url)


def test_logprobs_are_the_chat_format_of_the_model_s_log_softmax(url, tiny_gpt):
    r = client(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    prompt = BYTES.encode(chatml(MESSAGES))
    ids = answer_ids(tiny_gpt, MESSAGES, 6, temperature=0.0)
    with torch.no_grad():
        logits = tiny_gpt(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1].double()
    reference = torch.log_softmax(logits, dim=-1)
    assert len(content) == 6
    for k, entry in enumerate(content):
        assert entry.bytes == [ids[k]]  # a byte token is its own byte
        assert abs(entry.logprob - reference[k, ids[k]].item()) < 1e-4
        top = reference[k].topk(3)
        assert [t.bytes for t in entry.top_logprobs] == [[i] for i in top.indices.tolist()]
        for t, value in zip(entry.top_logprobs, top.values.tolist(), strict=True):
            assert abs(t.logprob - value) < 1e-4
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the top one


def test_stop_strings_and_penalties_reach_the_answer(url, tiny_gpt):
    sampled = dict(temperature=1.0, seed=3)
    text = BYTES.decode(answer_ids(tiny_gpt, MESSAGES, 16, **sampled))
    at = next(i for i in range(2, 14) if text.find(text[i : i + 2]) == i and text[i].isascii())
    r = client(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=16, stop=[text[at : at + 2]], **sampled
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text[:at], "stop")
    greedy = BYTES.decode(answer_ids(tiny_gpt, MESSAGES, 4, temperature=0.0))
    biased = {str(BYTES.encode(greedy[0])[0]): -100}  # the greedy first token is ruled out
    r = client(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=4, temperature=0, logit_bias=biased,
        frequency_penalty=0, presence_penalty=0,
    )  # fmt: skip
    expected = answer_ids(tiny_gpt, MESSAGES, 4, temperature=0.0, logit_bias={int(k): -100.0
                          for k in biased})  # fmt: skip
    assert r.choices[0].message.content == BYTES.decode(expected) != greedy
    penalised = dict(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0)
    r = client(url).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, **penalised
    )
    expected = BYTES.decode(answer_ids(tiny_gpt, MESSAGES, 8, **penalised))
    assert r.choices[0].message.content == expected != BYTES.decode(
        answer_ids(tiny_gpt, MESSAGES, 8, temperature=0.0))  # fmt: skip
    settled(url)


def test_a_model_without_a_chat_template_answers_400_naming_it(tiny_gpt):
    with serving(create_app(Engine(tiny_gpt), BYTES, NAME)) as base:
        with pytest.raises(openai.BadRequestError) as e:
            client(base).chat.completions.create(model=NAME, messages=MESSAGES)
        error = e.value.body
        assert "no chat template" in error["message"]
        assert (error["param"], error["code"]) == ("messages", "chat_template_missing")
        status, answer = request(base, "POST", "/tokenize", {"messages": MESSAGES})
        assert status == 400 and "no chat template" in answer["error"]["message"]


def test_tokenize_and_detokenize_speak_vllm_s_shapes(url):
    status, answer = request(url, "POST", "/tokenize", {"model": NAME, "prompt": "héllo"})
    assert status == 200
    assert answer == {"count": 6, "max_model_len": 64, "tokens": list("héllo".encode())}
    status, answer = request(url, "POST", "/tokenize", {"messages": MESSAGES})
    assert answer["tokens"] == BYTES.encode(chatml(MESSAGES))
    assert answer["count"] == len(answer["tokens"])
    status, answer = request(url, "POST", "/tokenize", {"prompt": "é", "return_token_strs": True})
    assert answer["token_strs"] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert request(url, "POST", "/detokenize", {"tokens": list("wörld".encode())}) == (
        200, {"prompt": "wörld"},
    )  # fmt: skip
    for body, param in [
        ({"tokens": [1, 256]}, "tokens"),
        ({"prompt": "a", "messages": MESSAGES}, "prompt"),
        ({"prompt": "a", "model": "gpt-9"}, "model"),
    ]:
        path = "/detokenize" if "tokens" in body else "/tokenize"
        status, answer = request(url, "POST", path, body)
        assert status in (400, 404) and answer["error"]["param"] == param, answer
    models = client(url).models.list().data
    assert [m.id for m in models] == [NAME] and models[0].model_extra["max_model_len"] == 64


def test_max_model_len_caps_the_context_an_answer_may_run_to(tiny_gpt):
    app = create_app(Engine(tiny_gpt), BYTES, NAME, chat_ids=chatml_ids, max_model_len=48)
    with serving(app) as base:
        assert client(base).models.list().data[0].model_extra["max_model_len"] == 48
        r = client(base).chat.completions.create(model=NAME, messages=MESSAGES, temperature=0)
        prompt_len = len(BYTES.encode(chatml(MESSAGES)))
        assert r.usage.completion_tokens + prompt_len == 48  # no max_tokens: to the context's end
        with pytest.raises(openai.BadRequestError) as e:
            client(base).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20)
        assert "context of 48" in e.value.body["message"]
    with pytest.raises(ValueError, match="max_model_len must be in"):
        create_app(Engine(tiny_gpt), BYTES, NAME, max_model_len=65)
