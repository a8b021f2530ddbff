"""The chat templates of the families dikkat runs, the real ones (llama.cpp keeps them for its
own tests, ``models/templates`` of the sdist ``make test`` unpacks beside its converter), with
tools and with thinking: each renders a conversation of offered tools, an earlier call and its
result (:func:`dikkat.serving.tools.conversation`, then the template itself where it renders
tools), the call syntax each family's models write is read back, and a thinking template's
prompt says whether the answer begins inside ``<think>``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dikkat.pretrained.chat_template import render_chat
from dikkat.serving.params import chat_messages
from dikkat.serving.protocol import ChatRequest
from dikkat.serving.reasoning import OPEN, split
from dikkat.serving.tools import conversation, tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}  # fmt: skip
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny and 21"},
]
# file → (renders tools itself, thinks in <think>, the call its models write)
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
LLAMA = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct": (True, False, LLAMA),
    "meta-llama-Llama-3.2-3B-Instruct": (True, False, LLAMA),
    "Qwen-Qwen2.5-7B-Instruct": (True, False, HERMES),
    "Qwen-Qwen3-0.6B": (True, True, HERMES),
    "HuggingFaceTB-SmolLM3-3B": (False, True, HERMES),
    "microsoft-Phi-3.5-mini-instruct": (False, False, None),
    "google-gemma-2-2b-it": (False, False, None),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (False, True, None),
}


def templates() -> Path:
    named = os.environ.get("DIKKAT_LLAMACPP_CONVERTER")
    folder = (Path(named) if named else Path(sys.prefix) / "llama.cpp-converter") / "models"
    if (folder / "templates").is_dir():
        return folder / "templates"
    if named:
        raise AssertionError(f"DIKKAT_LLAMACPP_CONVERTER={named} holds no models/templates")
    pytest.skip(f"llama.cpp's templates are not in {folder}: `make test` unpacks them there")


def render(template: str, messages: list, **variables: object) -> str:
    return render_chat(template, messages, bos_token="<s>", eos_token="</s>", **variables)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_s_template_renders_tools_and_results(family: str) -> None:
    knows, thinks, written = FAMILIES[family]
    template = (templates() / f"{family}.jinja").read_text()
    assert ("tools" in template) == knows and (OPEN in template) == thinks
    body = ChatRequest(model="m", tools=[WEATHER], messages=HISTORY)
    messages = conversation(chat_messages(body.messages), body, knows)
    prompt = render(template, messages, **({"tools": [WEATHER]} if knows else {}))
    for seen in ("get_weather", "The weather in a city now.", "Oslo", "sunny and 21"):
        assert seen in prompt, (family, seen)
    if written is not None:  # the call its models write is read back
        content, calls = tool_calls(written, ["get_weather"])
        assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
        assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.parametrize("family", [f for f, (_, thinks, _) in FAMILIES.items() if thinks])
def test_a_thinking_template_says_where_the_answer_begins(family: str) -> None:
    template = (templates() / f"{family}.jinja").read_text()
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    prompt = render(template, ask, add_generation_prompt=True)
    opened = prompt.rstrip().endswith(OPEN)  # as the server reads it
    answer = (
        "Blue light scatters most.</think>\n\nYes."
        if opened
        else "<think>\nBlue.\n</think>\n\nYes."
    )
    thinking, content = split(answer, opened)
    assert thinking and content == "Yes."
    if "enable_thinking" in template:  # Qwen 3's switch: the prompt closes the tag itself
        off = render(template, ask, add_generation_prompt=True, enable_thinking=False)
        assert off.rstrip().endswith("</think>") and not off.rstrip().endswith(OPEN)
