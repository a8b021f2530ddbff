"""Chat templates rendered as transformers' apply_chat_template renders them.

The reference is transformers' tokenizer of the same GGUF file, whose chat template it reads
from the header, rendering with ``tokenize=False``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from dikkat.pretrained.chat_template import render_chat
from dikkat.pretrained.gguf_file import GGUFFile

CONVERSATIONS = {
    "one question": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Türkiye?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write `print(1)` in\nPython 🐍."},
    ],
    "system multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "empty content": [{"role": "user", "content": ""}],
}

# the features HF chat templates use, in one template: the special tokens, loop variables and
# controls, a namespace, tojson with non-ASCII text and options, whitespace control, and
# variables passed through
FEATURES = """{{ bos_token }}
{% set ns = namespace(users=0) %}
{% for m in messages %}
  {% if m['role'] == 'skip' %}{% continue %}{% endif %}
  {% if m['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
  [{{ loop.index }}{{ '/last' if loop.last }}] {{ m['role'] | upper }}: {{ m['content'] | trim }}
  {{ m | tojson }} {{ m | tojson(indent=2, sort_keys=true) }}
  {% if m['content'] == 'stop' %}{% break %}{% endif %}
{% endfor %}
users={{ ns.users }} tools={{ tools is none }} extra={{ note | default('-') }}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"""

FEATURE_MESSAGES = [
    {"role": "system", "content": "  Sistem: çğıöşü 👍  "},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": 'say "<b>&</b>"'},
    {"role": "user", "content": "stop"},
    {"role": "assistant", "content": "never reached"},
]


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf: Path) -> str:
    return GGUFFile(smollm2_gguf).metadata["tokenizer.chat_template"]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("prompt", [True, False])
def test_smollm2_template_matches_transformers(name, prompt, smollm2_template, smollm2_hf):
    messages = CONVERSATIONS[name]
    ours = render_chat(
        smollm2_template,
        messages,
        add_generation_prompt=prompt,
        bos_token=smollm2_hf.bos_token,
        eos_token=smollm2_hf.eos_token,
    )
    theirs = smollm2_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == prompt  # not trivially equal


@pytest.mark.parametrize("prompt", [True, False])
def test_template_features_match_transformers(prompt, smollm2_hf):
    ours = render_chat(
        FEATURES,
        FEATURE_MESSAGES,
        add_generation_prompt=prompt,
        bos_token=smollm2_hf.bos_token,
        eos_token=smollm2_hf.eos_token,
        note="passed",
    )
    theirs = smollm2_hf.apply_chat_template(
        FEATURE_MESSAGES,
        chat_template=FEATURES,
        tokenize=False,
        add_generation_prompt=prompt,
        note="passed",
    )
    assert ours == theirs
    assert "çğıöşü 👍" in ours and "never" not in ours and "users=2" in ours


def test_a_template_refuses_with_its_own_message():
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    assert render_chat(template, [{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="Conversation roles must alternate user/assistant"):
        render_chat(template, [{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ("hello", TypeError, "messages must be a list"),
        ({"role": "user", "content": "hi"}, TypeError, "messages must be a list"),
        ([], ValueError, "messages is empty"),
        ([{"role": "user", "content": "a"}, "b"], ValueError, r"messages\[1\] must be a dict"),
        ([{"content": "a"}], ValueError, r"messages\[0\]\['role'\] must be a str, got nothing"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": None}],
            ValueError,
            r"messages\[1\]\['content'\] must be a str, got NoneType None",
        ),
        ([{"role": 1, "content": "a"}], ValueError, r"messages\[0\]\['role'\] must be a str"),
    ],
)
def test_bad_messages_are_refused_by_index(messages, error, match):
    with pytest.raises(error, match=match):
        render_chat("{{ messages }}", messages)


def test_a_template_runs_in_a_sandbox():
    # a template is code from a model's files: it cannot change what it is given
    with pytest.raises(ValueError, match="refused the conversation"):
        render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="refused the conversation"):
        render_chat(
            "{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "u", "content": "a"}]
        )


def test_a_broken_template_is_refused():
    with pytest.raises(ValueError, match=re.escape("not valid Jinja (line 1)")):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "a"}])
    with pytest.raises(TypeError, match="template must be a str"):
        render_chat(None, [{"role": "user", "content": "a"}])


def test_the_gemma3_base_model_has_no_template(gemma3_gguf: Path):
    # a base model: callers see None and refuse chat
    metadata = GGUFFile(gemma3_gguf).metadata
    assert metadata["general.architecture"] == "gemma3"
    assert metadata.get("tokenizer.chat_template") is None


# ---------------------------------------------------------------- bounds on a render

HI = [{"role": "user", "content": "hi"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_template_that_loops_is_stopped_by_its_steps():
    with pytest.raises(ValueError, match=r"limit of 10,000 steps \(max_steps\)"):
        render_chat(LOOPS, HI, max_steps=10_000)
    # every loop counts, not range's alone: three nested loops over 100 messages
    nested = "{% for a in messages %}{% for b in messages %}{% for c in messages %}" + (
        "{% endfor %}{% endfor %}{% endfor %}ok"
    )
    messages = HI * 100
    with pytest.raises(ValueError, match="max_steps"):
        render_chat(nested, messages, max_steps=100_000)
    assert render_chat(nested, messages, max_steps=2_000_000) == "ok"


def test_a_template_that_loops_is_stopped_by_the_clock():
    # a macro that calls itself twice, 40 deep: 2**40 calls, each a step, none past the budget
    doubling = (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    )
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"limit of 0\.3 seconds \(max_seconds\)"):
        render_chat(doubling, HI, max_seconds=0.3, max_steps=10**12)
    assert time.monotonic() - start < 10


def test_the_module_defaults_are_read_at_each_render(monkeypatch):
    import dikkat.pretrained.chat_template as chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDER_STEPS", 1_000)
    with pytest.raises(ValueError, match=r"limit of 1,000 steps"):
        render_chat(LOOPS, HI)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a' * 10**9 }}",
        "{{ ['a'] * 10**9 }}",
        "{{ 'a' | center(10**9) }}",
        "{{ 'a'.ljust(10**9) }}",
        "{{ '%1000000000d' % 1 }}",
        "{{ '{:>1000000000}'.format(1) }}",
        "{% set s = 'ab' * 100000 %}{{ s.replace('', s) }}",
        "{% set s = 'ab' * 1000000 %}{{ ([s] * 100) | join }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{% for i in range(100) %}{{ 'x' * 10**6 }}{% endfor %}",
    ],
)
def test_a_template_that_grows_a_value_is_stopped_before_it_fills_the_memory(template):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"limit of 10,000,000 characters \(max_chars\)"):
        render_chat(template, HI, max_chars=10_000_000)
    assert time.monotonic() - start < 10


def test_huge_numbers_and_deep_recursion_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"MAX_INT_BITS"):
        render_chat("{{ 7 ** 1000000 }}", HI)
    with pytest.raises(ValueError, match="recursed deeper than Python allows"):
        render_chat("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", HI)
    with pytest.raises(ValueError, match="the chat template failed: TypeError"):
        render_chat("{{ 'a' + 1 }}", HI)
    with pytest.raises(ValueError, match="the chat template failed: OverflowError: Range too big"):
        render_chat("{{ range(10**6) | list }}", HI)


def test_a_real_template_takes_few_steps(smollm2_template):
    messages = CONVERSATIONS["system multi-turn"]
    assert render_chat(smollm2_template, messages, max_steps=100) == render_chat(
        smollm2_template, messages
    )
    assert render_chat(FEATURES, FEATURE_MESSAGES, max_steps=400, note="x").endswith("<assistant>")


@pytest.mark.parametrize(
    "bound, value, error",
    [
        ("max_steps", 0, ValueError),
        ("max_steps", "many", TypeError),
        ("max_seconds", 0, ValueError),
        ("max_seconds", float("inf"), ValueError),
        ("max_chars", True, TypeError),
        ("max_chars", -1, ValueError),
    ],
)
def test_a_bound_that_is_no_bound_is_refused_by_name(bound, value, error):
    with pytest.raises(error, match=bound):
        render_chat(LOOPS, HI, **{bound: value})
