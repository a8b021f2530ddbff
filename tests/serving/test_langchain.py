"""One agent framework's OpenAI adapter against the server, unchanged: LangChain's
``ChatOpenAI`` runs a tool loop (a required call, the tool's result, the answer) and
``with_structured_output`` on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
langchain_openai = pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from live_server import serving_model  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402


@tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    return json.dumps({"city": city, "sky": "clear", "temperature": 21})


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


@pytest.fixture(scope="module")
def llm(smollm2):
    with serving_model(smollm2, "smollm2", max_batch=4, num_blocks=128) as base:
        yield langchain_openai.ChatOpenAI(
            model="smollm2", base_url=f"{base}/v1", api_key="none", temperature=0,
            max_tokens=80, max_retries=0,
        )  # fmt: skip


def test_a_tool_loop(llm):
    messages = [HumanMessage("What is the weather in Paris?")]
    asked = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    assert isinstance(asked, AIMessage) and asked.tool_calls
    for call in asked.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    messages.append(asked)
    for call in asked.tool_calls:
        result = get_weather.invoke(call["args"])
        messages.append(ToolMessage(result, tool_call_id=call["id"]))
    answer = llm.bind_tools([get_weather]).invoke(messages)  # auto: a call or an answer
    assert answer.content or answer.tool_calls


def test_structured_output(llm):
    city = llm.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City) and city.name
