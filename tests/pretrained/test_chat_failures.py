"""``dikkat chat`` and the chat API at their edges: a model whose output is NaN, a chat template
that never ends, and text that is not UTF-8 — each a one-line error, never an empty answer, a
hang or a traceback."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
import torch
from tiny_hf import save_tiny

import dikkat
from dikkat.generation import NonFiniteLogitsError
from helpers import run_cli

CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def tiny_folder(tmp_path, template: str = CHATML):
    save_tiny("llama", tmp_path)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": template}))
    return tmp_path


@pytest.fixture
def poisoned(tmp_path, monkeypatch):
    """A tiny chat model folder, loaded with a NaN in its final norm's weight (as a damaged
    file's output_norm.weight) by every dikkat.pretrained.load."""
    folder = tiny_folder(tmp_path)
    real = dikkat.pretrained.load

    def load(*args, **kwargs):
        lm = real(*args, **kwargs)
        with torch.no_grad():
            lm.model.norm_f.weight[0] = math.nan
        return lm

    monkeypatch.setattr(dikkat.pretrained, "load", load)
    return folder


def test_smollm2_with_a_nan_weight_says_so(smollm2_gguf):
    # fp32: the weights as plain tensors, so that the NaN reaches the logits through PyTorch's
    # own kernels (what a packed format's kernels make of a NaN input is theirs to test)
    lm = dikkat.pretrained.load(smollm2_gguf, weights="fp32")
    with torch.no_grad():
        lm.model.norm_f.weight[7] = math.nan
    with pytest.raises(NonFiniteLogitsError, match=r"NaN at step 0 \(new token 1\)"):
        lm.chat([{"role": "user", "content": "Hi"}], 4)
    with pytest.raises(NonFiniteLogitsError, match="weights or inputs hold non-finite values"):
        lm.generate("The capital of France is", 4)


def test_chat_with_a_nan_model_exits_with_one_line(poisoned, capsys):
    code, out, err = run_cli(["chat", str(poisoned), "-m", "hello", "-n", "5"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("dikkat: error: the model's output (its logits) is NaN")
    assert "Traceback" not in err
    code, out, err = run_cli(["generate", "--model", str(poisoned), "abc", "-n", "3"], capsys)
    assert code == 2 and "is NaN at step 0" in err.splitlines()[-1]


def test_a_template_that_loops_ends_chat_in_one_line(tmp_path, capsys, monkeypatch):
    import dikkat.pretrained.chat_template as chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDER_STEPS", 10_000)  # the default takes a second
    folder = tiny_folder(tmp_path, LOOPS)
    code, out, err = run_cli(["chat", str(folder), "-m", "hello"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith(
        "dikkat: error: the chat template ran past its limit of 10,000 steps (max_steps)"
    )


def test_message_bytes_that_are_not_utf8_are_refused_before_loading():
    # argv as the operating system hands it: bytes, which Python decodes with surrogateescape;
    # the refusal comes from the argument parser, before any model is looked for
    argv = [sys.executable, "-m", "dikkat.cli", "chat", "smollm2", "--message", b"caf\xe9 \xff"]
    result = subprocess.run(argv, capture_output=True, timeout=120)
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().splitlines() == [
        "dikkat: error: argument --message/-m: not valid UTF-8 text (byte 0xE9 at character "
        "3): give the text in UTF-8 (see `dikkat --help`)"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["chat", "smollm2", "--system", "\udcff", "-m", "hi"],
        ["generate", "--model", "smollm2", "caf\udce9"],
    ],
)
def test_every_text_argument_is_checked(argv, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "not valid UTF-8 text" in err and ("--system" in err or "argument prompt" in err)


def test_a_line_that_is_not_utf8_is_refused_and_the_conversation_goes_on(
    tmp_path, capsys, monkeypatch
):
    folder = tiny_folder(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("caf\udce9\nhello\n"))
    code, out, err = run_cli(["chat", str(folder), "-n", "3"], capsys)
    assert code == 0, err
    assert "dikkat: error: that line is not valid UTF-8 text (byte 0xE9 at character 3)" in err
    assert out.count("> ") == 3  # the refused line, "hello" and its answer, then the end


def test_the_library_refuses_such_text_by_name(tmp_path):
    lm = dikkat.pretrained.load(tiny_folder(tmp_path))
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] is not valid Unicode"):
        lm.chat_ids([{"role": "user", "content": "a\udcff"}])
    with pytest.raises(ValueError, match=r"text\[1\] is not valid Unicode text: character 0"):
        lm.generate(["ok", "\udcff"], 2)
