"""Tool calls through the server, on the real SmolLM2-135M-Instruct (a ChatML template that knows
no tools), with the official ``openai`` client: ``tool_choice`` ``required`` and a named
function give calls whose arguments validate against the function's schema, a streamed call
reassembles to the whole one, a conversation goes on after a tool's result, and a template that
renders tools itself gets them; what cannot be honoured is a 400 naming its field."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import jsonschema  # noqa: E402
from live_server import openai_client, serving_model  # noqa: E402

from dikkat.serving.protocol import ChatRequest  # noqa: E402
from dikkat.serving.tools import conversation, tool_calls  # noqa: E402

NAME = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(smollm2):
    with serving_model(smollm2, NAME) as base:
        yield base


client = openai_client


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_calls_validate(url, parallel):
    c = client(url)
    questions = ["What is the weather in Paris?", "What time is it in Tokyo?", "Hello!"]
    for question in questions:
        answer = c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": question}], tools=[WEATHER, TIME],
            tool_choice="required", parallel_tool_calls=parallel, max_tokens=80, temperature=0,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        assert parallel or len(choice.message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = c.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=80,
        temperature=0,
    )  # fmt: skip
    check_calls(answer.choices[0].message.tool_calls, {"get_time"})


def test_a_streamed_call_is_the_whole_one(url):
    c = client(url)
    common = dict(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                  max_tokens=80, temperature=0, logprobs=True)  # fmt: skip
    whole = c.chat.completions.create(**common).choices[0]
    parts: dict[int, dict[str, str]] = {}
    finish, logprobs = None, []
    for chunk in c.chat.completions.create(**common, stream=True):
        choice = chunk.choices[0]
        for delta_call in choice.delta.tool_calls or []:
            part = parts.setdefault(delta_call.index, {"name": "", "arguments": ""})
            part["name"] += delta_call.function.name or ""
            part["arguments"] += delta_call.function.arguments or ""
        finish = choice.finish_reason or finish
        logprobs += choice.logprobs.content if choice.logprobs else []
    assert finish == "tool_calls"
    assert [parts[i] for i in sorted(parts)] == [
        {"name": w.function.name, "arguments": w.function.arguments}
        for w in whole.message.tool_calls
    ]
    assert [e.token for e in logprobs] == [e.token for e in whole.logprobs.content]


def test_a_conversation_goes_on_after_a_result(url):
    c = client(url)
    first = c.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0,
    ).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = c.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=40,
        temperature=0,
    ).choices[0]  # fmt: skip
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert answer.message.tool_calls is None
    auto = c.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
    ).choices[0]  # (auto: a call or a text, either read back whole)
    assert auto.message.content or auto.message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "no tools are given"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "names 'x'",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "name a function twice"),
        (
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            "response_format",
            "tools and a constraint",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated form of tools"),
        ({"tools": [WEATHER], "extra_body": {"min_tokens": 2}}, "tools", "cannot both hold"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(url, extra: dict, param: str, message: str):
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(model=NAME, messages=ASK, max_tokens=4, **extra)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error


# --- without a server: the messages as a template gets them, and the answer read back ------


def test_a_template_that_knows_tools_gets_them_as_they_are():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    body = ChatRequest(model=NAME, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])  # fmt: skip
    from dikkat.serving.params import chat_messages

    messages = chat_messages(body.messages)
    known = conversation(messages, body, knows_tools=True)
    assert known[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert known[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    plain = conversation(messages, body, knows_tools=False)
    assert plain[0]["role"] == "user" and "get_weather" in plain[0]["content"]
    assert plain[0]["content"].endswith("\n\nWeather?")  # the description, then the question
    assert json.loads(plain[1]["content"]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert plain[2] == {"role": "user", "content": "The result of get_weather: sunny"}
    told = conversation([{"role": "system", "content": "Be brief."}, *messages], body, False)
    assert told[0]["content"].startswith("Be brief.\n\nYou can call") and told[1] == messages[0]


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ('{"name": "get_time", "arguments": {"zone": "UTC"}}', None, ["get_time"]),
        (
            '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
            None,
            ["get_time", "get_time"],
        ),
        (
            'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
            "</tool_call>",
            "Let me look.",
            ["get_time"],
        ),
        ('{"name": "delete_all", "arguments": {}}', '{"name": "delete_all", "arguments": {}}', []),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        ("Just text.", "Just text.", []),
    ],
)
def test_an_answer_is_read_back(text: str, content: str | None, names: list[str]):
    got_content, calls = tool_calls(text, ["get_time", "get_weather"])
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == names
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


HERMES = (
    "{% if tools %}<|im_start|>system\nYou may call:\n{% for t in tools %}{{ t.function | tojson }}"
    "\n{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{% else %}"
    "{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_template_that_knows_tools_renders_them(smollm2):
    """Served with a template that writes tools (as Qwen's does, in a form of its own): the
    tools and the earlier calls reach it, and the answer is read back the same."""
    knower = copy.copy(smollm2)
    knower.chat_template = HERMES
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]  # fmt: skip
    expected = knower.chat_prompt(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather",
                                  "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_7"}],
        tools=[WEATHER],
    )  # fmt: skip
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"' in expected
    with serving_model(smollm2, NAME, knower.chat_ids, max_batch=2, num_blocks=64) as base:
        c = client(base)
        answer = c.chat.completions.create(
            model=NAME, messages=history, tools=[WEATHER], tool_choice="required",
            max_tokens=60, temperature=0,
        )  # fmt: skip
        assert answer.usage.prompt_tokens == len(
            smollm2.tokenizer.encode(expected, add_special=False)
        )
        check_calls(answer.choices[0].message.tool_calls, {"get_weather"})
