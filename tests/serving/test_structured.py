"""Structured outputs through the server, on the real SmolLM2-135M-Instruct, with the official
``openai`` client: ``chat.completions.parse`` with a pydantic model gives a parsed object for
every prompt, each field that sets a constraint (OpenAI's, vLLM's, llama-server's) holds the
text to it, streamed or whole, and a constraint that cannot be honoured is a 400 naming its
field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import jsonschema  # noqa: E402
from live_server import openai_client, serving_model  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

NAME = "smollm2"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "port", "other"]


@pytest.fixture(scope="module")
def url(smollm2):
    with serving_model(smollm2, NAME, max_batch=16) as base:
        yield base


client = openai_client


PLACES = [
    "Paris", "Tokyo", "Ankara", "Lagos", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Rome",
    "Dakar", "Seoul", "Izmir", "Porto", "Perth", "Delhi", "Kyiv", "Baku", "Riga", "Accra",
]  # fmt: skip


def test_parse_gives_an_object_for_every_prompt(url):
    """20 prompts at once (the engine batches them): every answer parses into the model."""
    c = client(url)

    def ask(place: str) -> Any:
        return c.chat.completions.parse(
            model=NAME,
            messages=[{"role": "user", "content": f"Describe the city of {place} as JSON."}],
            response_format=City,
            max_tokens=96,
            temperature=0,
        )

    with ThreadPoolExecutor(len(PLACES)) as pool:
        answers = list(pool.map(ask, PLACES))
    schema = City.model_json_schema()
    for answer in answers:
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, City)
        jsonschema.validate(json.loads(message.content), schema)


def test_each_field_holds_the_text(url):
    c = client(url)
    ask = [{"role": "user", "content": "Is the sky blue?"}]

    def chat(**extra: Any) -> str:
        answer = c.chat.completions.create(
            model=NAME, messages=ask, max_tokens=40, temperature=0, **extra
        )
        return answer.choices[0].message.content

    def complete(**extra: Any) -> str:
        answer = c.completions.create(
            model=NAME, prompt="The answer is", max_tokens=40, temperature=0, **extra
        )
        return answer.choices[0].text

    assert chat(extra_body={"guided_choice": ["yes", "no"]}) in ("yes", "no")
    assert complete(extra_body={"guided_choice": [" maybe", " never"]}) in (" maybe", " never")
    assert re.fullmatch(r"[A-Z][a-z]+ \d", chat(extra_body={"guided_regex": r"[A-Z][a-z]+ \d"}))
    vllm = {"structured_outputs": {"regex": r"(yes|no), because [a-z ]{1,30}\."}}
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", chat(extra_body=vllm))
    gbnf = 'root ::= "[" [0-9] ("," [0-9])* "]"'  # llama-server's grammar field, GBNF
    assert re.fullmatch(r"\[\d(,\d)*\]", complete(extra_body={"grammar": gbnf}))
    schema = {"type": "object", "properties": {"blue": {"type": "boolean"}},
              "required": ["blue"], "additionalProperties": False}  # fmt: skip
    for extra in (
        {"extra_body": {"json_schema": schema}},  # llama-server's
        {"extra_body": {"guided_json": schema}},  # vLLM's older field
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            }
        },
    ):
        jsonschema.validate(json.loads(chat(**extra)), schema)
    assert isinstance(json.loads(chat(response_format={"type": "json_object"})), dict)


def test_a_stream_is_held_too(url):
    schema = City.model_json_schema() | {"additionalProperties": False}  # as strict mode has it
    stream = client(url).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Describe Istanbul."}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


BAD_SCHEMA = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "foo"}},
    }
}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (BAD_SCHEMA, "response_format", "Invalid type"),
        ({"guided_regex": "a(b"}, "guided_regex", "guided_regex: regex:"),
        ({"response_format": {"type": "grammar"}}, "response_format", "'grammar' is not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs {'json_schema'"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"guided_choice": ["a"], "grammar": "root ::= 'a'"}, "grammar", "one constraint at most"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(url, extra: dict, param: str, message: str):
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            extra_body=extra,
        )  # fmt: skip
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error
