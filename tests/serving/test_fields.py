"""Which request fields the server takes: every field of OpenAI's two endpoints is accepted
(honoured, or ignored where it cannot change the answer), the impossible ones are refused by
name, and no body a client sends — however malformed — gets a 500 or stops the server."""

from __future__ import annotations

import json
from typing import Any, get_type_hints

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from live_server import WAIT, request, serving, settled  # noqa: E402

from conftest import chatml_ids  # noqa: E402
from dikkat.generation import SamplingParams, generate  # noqa: E402
from dikkat.serving import Engine, create_app  # noqa: E402
from dikkat.serving.protocol import (  # noqa: E402
    ChatRequest,
    CompletionRequest,
    RequestError,
    StreamOptions,
)
from dikkat.text import ByteTokenizer  # noqa: E402

NAME = "tiny"
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": NAME, "messages": USER, "max_tokens": 3}
TEXT = {"model": NAME, "prompt": "hi", "max_tokens": 3}
IMAGE = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
TOOL_CALL = {"role": "assistant", "tool_calls": [{"id": "1"}]}


def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


@pytest.fixture(scope="module")
def url(tiny_gpt):
    app = create_app(Engine(tiny_gpt, max_batch=4), ByteTokenizer(), NAME, chat_ids=chatml_ids)
    with serving(app) as base:
        yield base


def test_every_field_of_the_openai_client_is_a_field_of_the_server():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    for params, model in (
        (completion_create_params.CompletionCreateParamsBase, CompletionRequest),
        (chat_params.CompletionCreateParamsBase, ChatRequest),
    ):
        sent = set(get_type_hints(params)) | {"stream"}
        assert sent - set(model.model_fields) == set(), model.__name__
    from openai.types.chat import ChatCompletionStreamOptionsParam

    assert set(get_type_hints(ChatCompletionStreamOptionsParam)) <= set(StreamOptions.model_fields)


def test_fields_that_change_nothing_are_taken(url):
    """What an OpenAI client sends by habit: explicit defaults, and fields about billing,
    storage and tools that a local model has nothing to do with."""
    c = client(url)
    r = c.completions.create(
        **TEXT, frequency_penalty=0, presence_penalty=0, logit_bias={}, user="u", best_of=1,
        suffix="", n=1, top_p=1, stream_options=None,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    r = c.chat.completions.create(
        **CHAT, frequency_penalty=0, presence_penalty=0, store=False, metadata={"run": "1"},
        parallel_tool_calls=False, service_tier="auto", response_format={"type": "text"},
        user="u", reasoning_effort="low", verbosity="low", tool_choice="none", tools=[],
        modalities=["text"], prompt_cache_key="k", safety_identifier="s",
        prediction={"type": "content", "content": "hi"}, seed=1, top_logprobs=0,
    )  # fmt: skip
    assert r.choices[0].message.content is not None
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
    ]
    status, answer = request(url, "POST", "/v1/chat/completions", {**CHAT, "messages": messages})
    assert status == 200, answer
    status, answer = request(url, "POST", "/tokenize", {"messages": messages})
    assert answer["tokens"] == list(b"<system>be brief\n<user>hi\n<assistant>")


def test_a_field_sent_as_null_is_a_field_not_sent(url):
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stop", "stream", "stream_options",
                           "seed", "logit_bias", "user", "frequency_penalty"])  # fmt: skip
    for path, body, more in [
        ("/v1/chat/completions", CHAT, ["logprobs", "top_logprobs", "tools", "tool_choice",
                                        "response_format", "max_completion_tokens"]),
        ("/v1/completions", TEXT, ["echo", "logprobs", "best_of", "suffix"]),
    ]:  # fmt: skip
        status, answer = request(url, "POST", path, {**body, **nulls, **dict.fromkeys(more)})
        assert status == 200, answer
        assert answer["choices"][0]["finish_reason"] == "length"
    status, answer = request(url, "POST", path, {**body, "model": None})
    assert (status, answer["error"]["param"]) == (400, "model")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**TEXT, "suffix": "end"}, "suffix"),
        ({**TEXT, "best_of": 1, "n": 2}, "best_of"),
        ({**TEXT, "n": 0}, "n"),
        ({**TEXT, "logprobs": 21}, "logprobs"),
        ({**TEXT, "logprobs": True}, "logprobs"),
        ({**TEXT, "prompt": [[1, 2], []]}, "prompt"),
        ({**TEXT, "prompt": [[1, 2], "ab"]}, "prompt"),
        ({**TEXT, "prompt": ["ab"] * 65}, "prompt"),  # past the engine's queue of 64
        ({**TEXT, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({**TEXT, "logit_bias": {"300": 1}}, "logit_bias"),
        ({**TEXT, "logit_bias": {"3": 101}}, "logit_bias"),
        ({**TEXT, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({**TEXT, "stop": [""]}, "stop"),
        ({**TEXT, "max_tokens": 0, "prompt": "x" * 65}, "prompt"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
        # (the byte model has no end-of-text id, which a constrained text ends with)
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),  # no schema
        ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ({**CHAT, "web_search_options": {}}, "web_search_options"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": 63}, "max_tokens"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({**CHAT, "messages": [IMAGE]}, "messages[0].content[0].type"),
        ({**CHAT, "messages": [TOOL_CALL]}, "messages"),  # a call without its function
        ({**CHAT, "temperature": 2.5}, "temperature"),
        ({**TEXT, "min_tokens": 4}, "min_tokens"),  # above max_tokens
        ({**CHAT, "min_tokens": -1}, "min_tokens"),
        ({**CHAT, "ignore_eos": "yes"}, "ignore_eos"),
        ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ({**TEXT, "repetition_penalty": 1.2, "repeat_penalty": 1.1}, "repeat_penalty"),
        ({**CHAT, "colour": "blue"}, "colour"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(url, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = request(url, "POST", path, body)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param, answer
    words = param.split(".")[-1].split("[")[0]
    assert words in answer["error"]["message"] or param == "messages", answer


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "best_of", "logprobs", "echo",
          "stream", "stop", "seed", "temperature", "top_p", "logit_bias", "top_logprobs",
          "stream_options", "tokens", "response_format", "max_completion_tokens"]  # fmt: skip


@st.composite
def bodies(draw: Any) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                                 "/detokenize"]))  # fmt: skip
    kind = draw(st.integers(0, 3))
    if kind == 0:  # anything at all
        return path, draw(st.binary(max_size=40))
    if kind == 1:  # a JSON value that may not be an object
        return path, json.dumps(draw(json_values)).encode()
    body = dict(CHAT if "chat" in path else TEXT)
    if path == "/detokenize":
        body = {"tokens": [1, 2]}
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        if draw(st.booleans()):
            body.pop(field, None)
        else:
            body[field] = draw(json_values)
    return path, json.dumps(body).encode()


def test_no_malformed_body_gets_a_500_or_stops_the_server(url):
    seen: set[int] = set()

    @settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(bodies())
    def check(case: tuple[str, bytes]) -> None:
        path, body = case
        status, answer = request(url, "POST", path, body)
        seen.add(status)
        assert status in (200, 400, 404), (path, body, status, answer)
        if status != 200:
            assert set(answer["error"]) == {"message", "type", "param", "code"}

    check()
    assert 400 in seen
    r = client(url).chat.completions.create(**CHAT, temperature=0)  # it still serves
    assert r.choices[0].finish_reason == "length"
    settled(url)


def test_min_tokens_and_ignore_eos_as_vllm_takes_them(tiny_gpt):
    """With the greedy first token as the one stop token: it ends the answer at once; with
    ``min_tokens`` 3 it cannot come before token 4 (the engine's tokens are ``generate``'s); with
    ``ignore_eos`` it ends nothing and the answer runs to ``max_tokens``."""
    prompt = list(b"hi")
    first = generate(tiny_gpt, [prompt], 1)[0][-1]
    app = create_app(Engine(tiny_gpt, max_batch=2), ByteTokenizer(), NAME, stop_ids=(first,))
    body = {**TEXT, "max_tokens": 6, "temperature": 0}
    with serving(app) as base:
        c = client(base)
        plain = c.completions.create(**body)
        assert (plain.choices[0].finish_reason, plain.usage.completion_tokens) == ("stop", 1)
        r = c.completions.create(**body, extra_body={"min_tokens": 3})
        p = SamplingParams(max_new_tokens=6, stop_ids=(first,), min_new_tokens=3)
        want = generate(tiny_gpt, [prompt], p)[0][len(prompt) :]
        assert first not in want[:3] and r.usage.completion_tokens == len(want)
        assert r.choices[0].text == ByteTokenizer().decode(
            want[: -1 if want[-1] == first else None]
        )
        r = c.completions.create(**body, extra_body={"ignore_eos": True})
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 6)
        settled(base)


def test_the_repetition_penalty_under_either_name_gives_generate_s_tokens(tiny_gpt):
    """vLLM's ``repetition_penalty`` and llama-server's ``repeat_penalty``: the engine counts the
    prompt's tokens as seen, as ``generate`` does."""
    prompt = list(b"hello hello")
    want = generate(tiny_gpt, [prompt], SamplingParams(max_new_tokens=8, repetition_penalty=1.8))
    app = create_app(Engine(tiny_gpt, max_batch=2), ByteTokenizer(), NAME)
    body = {**TEXT, "prompt": "hello hello", "max_tokens": 8, "temperature": 0}
    with serving(app) as base:
        c = client(base)
        for name in ("repetition_penalty", "repeat_penalty"):
            r = c.completions.create(**body, extra_body={name: 1.8})
            assert r.choices[0].text == ByteTokenizer().decode(want[0][len(prompt) :]), name
        assert c.completions.create(**body).choices[0].text != r.choices[0].text
        settled(base)


def test_a_request_converts_itself_into_sampling_params():
    """Each field is the client's, else the server's default, else OpenAI's; a value
    ``SamplingParams`` refuses is a refusal naming the field."""
    body = CompletionRequest(**TEXT, n=2, best_of=3, logprobs=1, echo=True, top_p=1.0, top_k=-1,
                             seed=-1, logit_bias={"7": -2, "3": 1})  # fmt: skip
    p = body.to_sampling_params((5,), vocab_size=10)
    assert (p.max_new_tokens, p.n, p.stop_ids, p.top_p, p.top_k, p.seed) == (
        3, 3, (5,), None, None, 2**64 - 1,
    )  # fmt: skip
    assert (p.logprobs, p.top_logprobs, p.prompt_logprobs) == (True, 1, True)
    assert p.logit_bias == ((3, 1.0), (7, -2.0))
    chat = ChatRequest(**{**CHAT, "max_tokens": None}).to_sampling_params(9, (), vocab_size=10)
    assert (chat.max_new_tokens, chat.temperature, chat.logprobs) == (9, 1.0, False)
    with pytest.raises(RequestError, match=r"logit_bias\[3\] = 101.0: a bias") as e:
        CompletionRequest(**TEXT, logit_bias={"3": 101}).to_sampling_params((), vocab_size=10)
    assert e.value.param == "logit_bias"
    with pytest.raises(RequestError, match="logit_bias names '10', not a token id") as e:
        CompletionRequest(**TEXT, logit_bias={"10": 1}).to_sampling_params((), vocab_size=10)
    assert e.value.param == "logit_bias"
