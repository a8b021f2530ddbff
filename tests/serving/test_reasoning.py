"""A model that thinks in ``<think>`` tags: its thinking comes back as ``reasoning_content``,
whole or streamed in any pieces, and ``chat_template_kwargs`` reach its template. The server
test serves SmolLM2 under a ChatML template that thinks (it opens or closes the tag as Qwen 3's
does with ``enable_thinking``), its answers shaped by a regular expression so that they think."""

from __future__ import annotations

import copy
import functools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dikkat.serving.reasoning import Splitter, split

# --- the split, whole and streamed ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nhmm\n</think>\n\nYes.", False, ("\nhmm\n", "Yes.")),
        ("hmm</think>Yes.", True, ("hmm", "Yes.")),  # the prompt opened the tag
        ("Yes, <think> is a tag.", False, (None, "Yes, <think> is a tag.")),
        ("<think>cut short", False, ("cut short", "")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("", True, ("", "")),
    ],
)
def test_a_whole_answer_splits(text: str, opened: bool, expected: tuple) -> None:
    assert split(text, opened) == expected


@given(
    body=st.lists(st.sampled_from(["<think>", "</think>", "<", "</th", "a", "\n", " ", "ink>"]),
          max_size=12).map("".join),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    opened=st.booleans(),
)  # fmt: skip
def test_a_stream_splits_as_the_whole(body: str, cuts: list[int], opened: bool) -> None:
    """Whatever the pieces, the streamed parts add up to the whole text's split."""
    splitter, parts, at = Splitter(opened), [], 0
    for cut in sorted(c for c in cuts if c <= len(body)):
        parts += splitter.push(body[at:cut])
        at = cut
    parts += splitter.push(body[at:]) + splitter.finish()
    thinking = "".join(t for k, t in parts if k == "reasoning")
    answer = "".join(t for k, t in parts if k == "content")
    whole = split(body, opened)
    assert ((thinking if splitter.thought else None), answer) == whole


# --- through the server ----------------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from live_server import openai_client, serving_model  # noqa: E402

NAME = "thinker"
THINKING = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
SHAPE = r"<think>[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{2,20}\."


@pytest.fixture(scope="module")
def url(smollm2):
    thinker = copy.copy(smollm2)
    thinker.chat_template = THINKING
    chat_ids = functools.partial(thinker.chat_ids, special_in_content=False)  # as dikkat serve's
    with serving_model(smollm2, NAME, chat_ids, max_batch=4, num_blocks=64) as base:
        yield base


client = openai_client


ASK = [{"role": "user", "content": "Is the sky blue?"}]


def test_thinking_is_reasoning_content(url):
    common = dict(model=NAME, messages=ASK, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": SHAPE})  # fmt: skip
    whole = client(url).chat.completions.create(**common).choices[0].message
    thinking, answer = whole.model_extra["reasoning_content"], whole.content
    assert re.fullmatch(r"[a-z ]{4,30}", thinking) and re.fullmatch(r"[A-Z][a-z ]{2,20}\.", answer)
    streamed: dict[str, str] = {"reasoning_content": "", "content": ""}
    for chunk in client(url).chat.completions.create(**common, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            streamed["content"] += delta.content or ""
            streamed["reasoning_content"] += (delta.model_extra or {}).get(
                "reasoning_content"
            ) or ""
    assert streamed == {"reasoning_content": thinking, "content": answer}


def test_chat_template_kwargs_reach_the_template(url):
    c = client(url)
    off = c.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                    "guided_regex": r"[A-Z][a-z]{2,8}\."},
    )  # fmt: skip
    on = c.chat.completions.create(model=NAME, messages=ASK, max_tokens=1, temperature=0)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the closed tag, in the prompt
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    assert re.fullmatch(r"[A-Z][a-z]{2,8}\.", off.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as caught:
        bad = {"chat_template_kwargs": {"messages": []}}
        c.chat.completions.create(model=NAME, messages=ASK, max_tokens=1, extra_body=bad)
    assert caught.value.body["param"] == "chat_template_kwargs"
