"""``dikkat export RUN --gguf OUT``: a tiny run folder written as a GPT-2 GGUF file and read
back by ``dikkat.pretrained.load``; what it refuses, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dikkat
from dikkat.models import GPT, BERTConfig, GPTConfig
from dikkat.models.bert import BERT
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import TrainConfig, Trainer
from helpers import run_cli

SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_len": 32}


def run_of(path: Path, model: dict | None = None, **spec: object) -> Path:
    """A real lm run at step 0 (what export reads needs no trained weights), its GPT ``SMALL``
    with ``model``'s fields changed."""
    overrides = {**SMALL, **(model or {})}
    task = TaskSpec(task="lm", seq_len=16, data=json.__file__, model_overrides=overrides, **spec)
    Trainer(build_task(task), TrainConfig(steps=1, batch_size=2), path).save()
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return run_of(tmp_path_factory.mktemp("runs") / "gpt")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_export_writes_what_load_reads_back(run, dtype, tmp_path, capsys):
    out = tmp_path / "gpt.gguf"
    code, stdout, err = run_cli(["export", str(run), "--gguf", str(out), "--dtype", dtype], capsys)
    assert (code, err) == (0, "")
    assert f"wrote {out}" in stdout and "gpt2, 1 layers, width 16" in stdout and dtype in stdout
    model = GPT.load(run).eval()
    lm = dikkat.pretrained.load(out)
    assert lm.model.config == model.config
    ids = torch.tensor([lm.tokenizer.encode("import os\n")])
    assert ids.tolist() == [list(b"import os\n")]  # the run's bytes tokenizer
    with torch.no_grad():
        want, got = model(ids), lm.model(ids)
    if dtype == "f32":
        assert torch.equal(got, want)
    else:  # matrices in fp16: close, not equal
        assert 0 < (got - want).abs().max() < 1e-2


def test_a_bpe_run_exports_its_merges(tmp_path, capsys):
    run = run_of(tmp_path / "bpe", tokenizer="bpe", vocab_size=300, max_bytes=20000)
    out = tmp_path / "bpe.gguf"
    assert run_cli(["export", str(run), "--gguf", str(out)], capsys)[0] == 0
    from dikkat.text import load_tokenizer

    mine, back = load_tokenizer(run), dikkat.pretrained.load(out).tokenizer
    text = "def main():\n    return json.dumps(obj)\n"
    assert back.encode(text) == mine.encode(text)
    assert len(mine.encode(text)) < len(text)  # merged: the merges came along


def test_an_existing_file_needs_overwrite(run, tmp_path, capsys):
    out = tmp_path / "gpt.gguf"
    out.write_bytes(b"old")
    code, _, err = run_cli(["export", str(run), "--gguf", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and "--overwrite" in err
    assert out.read_bytes() == b"old"
    assert run_cli(["export", str(run), "--gguf", str(out), "--overwrite"], capsys)[0] == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_the_demo_s_rope_gpt_is_a_starcoder2_file(tmp_path, capsys):
    """The demo trains a GPT with RoPE (``model_overrides`` in ``dikkat.cli.demo``)."""
    run = run_of(tmp_path / "demo", {"position": "rope"})
    out = tmp_path / "demo.gguf"
    code, stdout, err = run_cli(["export", str(run), "--gguf", str(out)], capsys)
    assert (code, err) == (0, "")
    assert "starcoder2, 1 layers, width 16" in stdout
    model = GPT.load(run).eval()
    assert model.config.position == "rope"
    lm = dikkat.pretrained.load(out)
    assert lm.model.config == model.config
    ids = torch.tensor([lm.tokenizer.encode("import os\n")])
    with torch.no_grad():
        assert torch.equal(lm.model(ids), model(ids))
    code, stdout, err = run_cli(
        ["generate", "--model", str(out), "import", "-n", "8", "--eager"], capsys
    )
    code2, stdout2, _ = run_cli(["generate", str(run), "import", "-n", "8"], capsys)
    assert code == code2 == 0 and stdout == stdout2  # greedy: the run's own tokens


def test_what_has_no_gguf_is_refused_in_one_line(run, tmp_path, capsys):
    gelu = tmp_path / "gelu"
    GPT(GPTConfig(vocab_size=256, max_len=16, d_model=16, n_heads=2, activation="gelu")).save(gelu)
    bert = tmp_path / "bert"
    BERT(BERTConfig(vocab_size=256, max_len=16, d_model=16, n_heads=2, n_layers=1)).save(bert)
    for folder, words in [
        (gelu, "activation='gelu'"),
        (bert, "holds a saved BERT, not a GPT"),
        (tmp_path / "nowhere", "does not exist"),
    ]:
        code, _, err = run_cli(["export", str(folder), "--gguf", str(tmp_path / "x.gguf")], capsys)
        assert code == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "x.gguf").exists()
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(["export", str(run), "--gguf", str(tmp_path / "file" / "x")], capsys)
    assert code == 2 and err.startswith("dikkat: error: cannot write") and err.count("\n") == 1
