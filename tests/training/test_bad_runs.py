"""Runs that must not go on, and folders that must not be touched: each case ends in one clear
line (or exception) naming what is wrong, and leaves every file as it was.

Covered: training configs, run folders that hold something else (a model, another run, foreign
files, a file), unwritable folders, resuming with fewer steps, runs whose tokenizer or weights
are missing or damaged, a model too big for the machine, a run that diverges, and runs written
by an older dikkat (flat files), which still resume.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dikkat import runs
from dikkat.models import GPT, GPTConfig
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import (
    STATE_FILE,
    TASK_FILE,
    DivergedError,
    TrainConfig,
    Trainer,
    resume_trainer,
)
from helpers import run_cli, shared_text

TEXT = shared_text("dikkat-test-bad-input-corpus.txt", Path(json.__file__).read_text() * 3)
TINY = [
    "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16", "--data", str(TEXT),
    "--batch-size", "2", "--eval-every", "0", "--no-progress",
]  # fmt: skip
SPEC = TaskSpec(
    task="lm",
    seq_len=16,
    data=str(TEXT),
    model_overrides={"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 16},
)
CONFIG = TrainConfig(steps=4, batch_size=2, warmup=1, eval_every=0, eval_batches=1)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def train_cli(capsys, out: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli(
        ["train", "--task", "lm", "--steps", "3", "--out", str(out), *TINY, *extra], capsys
    )


# --- configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("min_lr_ratio", -0.5, ValueError),  # a negative learning rate at the end of the cosine
        ("min_lr_ratio", 1.5, ValueError),
        ("grad_clip", -1.0, ValueError),  # clipping silently off
        ("lr", math.inf, ValueError),
        ("lr", math.nan, ValueError),
        ("lr", 0.0, ValueError),
        ("beta2", 1.0, ValueError),
        ("weight_decay", -0.1, ValueError),
        ("warmup", -1, ValueError),
        ("steps", 2.5, TypeError),
        ("batch_size", True, TypeError),
        ("seed", -1, ValueError),
        ("bf16", "yes", TypeError),
        ("eval_batches", 0, ValueError),
    ],
)
def test_train_config_names_the_bad_field(field, value, error):
    with pytest.raises(error, match=rf"^{field} must be"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("task", "chat", ValueError),
        ("tokenizer", "words", ValueError),
        ("vocab_size", 100, ValueError),  # a byte-level BPE starts from 256 tokens
        ("seq_len", 1, ValueError),
        ("max_bytes", 0, ValueError),
        ("seed", 0.5, TypeError),
        ("model_overrides", ["d_model"], TypeError),
        ("data", 3, TypeError),
    ],
)
def test_task_spec_names_the_bad_field(field, value, error):
    with pytest.raises(error, match=rf"^{field} must be"):
        TaskSpec(**{field: value})


# --- folders that hold something else --------------------------------------------------------


@pytest.fixture(scope="module")
def task():
    return build_task(SPEC)


def test_a_trainer_never_replaces_what_it_did_not_make(task, tmp_path):
    model_dir = tmp_path / "model"
    GPT(GPTConfig.preset("tiny")).save(model_dir)
    before = snapshot(model_dir)
    with pytest.raises(ValueError, match="already holds a saved model"):
        Trainer(task, CONFIG, model_dir)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(ValueError, match="files that dikkat did not write"):
        Trainer(task, CONFIG, tmp_path / "notes")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        Trainer(task, CONFIG, tmp_path / "file")
    assert snapshot(model_dir) == before
    # asked to, it replaces the model (and leaves nothing of it behind)
    Trainer(task, CONFIG, model_dir, overwrite=True).train(progress=False)
    assert runs.folder_kind(model_dir) == "run"
    assert not (model_dir / "config.json").exists()
    assert isinstance(GPT.load(model_dir), GPT)  # the run's own model now


def test_train_and_demo_refuse_folders_in_use(tmp_path, capsys):
    model_dir = tmp_path / "model"
    GPT(GPTConfig.preset("tiny")).save(model_dir)
    before = snapshot(model_dir)
    code, _, err = train_cli(capsys, model_dir)
    assert code == 2 and "already holds a saved model" in err and "--overwrite" in err
    code, _, err = run_cli(["demo", "--steps", "1", "--out", str(model_dir)], capsys)
    assert code == 2 and "already holds a saved model" in err
    assert snapshot(model_dir) == before
    run_dir = tmp_path / "run"
    assert train_cli(capsys, run_dir)[0] == 0
    before = snapshot(run_dir)
    code, _, err = run_cli(["demo", "--steps", "1", "--out", str(run_dir)], capsys)
    assert code == 2 and "already holds a training run" in err  # not the demo's own run
    code, _, err = train_cli(capsys, run_dir)
    assert code == 2 and "pass --resume to continue it" in err
    code, _, err = train_cli(capsys, run_dir, "--resume", "--overwrite")
    assert code == 2 and "--resume continues the run" in err
    assert snapshot(run_dir) == before
    code, _, err = train_cli(capsys, run_dir, "--overwrite")
    assert code == 0, err
    assert runs.made_by(run_dir) == "dikkat train"


def test_the_demo_replaces_only_its_own_run(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--steps", "1", "--leak-steps", "1", "--sample-tokens", "2", "--seq-len",
            "16", "--batch-size", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert run_cli(argv, capsys)[0] == 0
    assert runs.made_by(out) == "dikkat demo"
    first = runs.read_pointer(out)
    code, _, err = run_cli(argv, capsys)  # `make demo` twice
    assert code == 0, err
    assert runs.read_pointer(out)["checkpoint"] == first["checkpoint"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        first["checkpoint"]
    ]


def test_out_that_cannot_be_written_is_found_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, _, err = train_cli(capsys, tmp_path / "file")
    assert code == 2 and "--out" in err and "is a file" in err
    code, _, err = train_cli(capsys, tmp_path / "file" / "run")
    assert code == 2 and "cannot be created" in err
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: a read-only mount stops it
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)])
        if r.returncode != 0:
            pytest.skip("as root, a read-only folder needs a read-only mount, not allowed here")
    else:
        ro.chmod(0o555)
    try:
        code, out, err = train_cli(capsys, ro / "run")
        assert code == 2 and "not writable" in err, err
        assert "steps" not in out  # no training started
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False)
        ro.chmod(0o755)


# --- resuming --------------------------------------------------------------------------------


def test_resume_with_fewer_steps_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_cli(capsys, out)[0] == 0
    before = snapshot(out)
    code, _, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "2"], capsys)
    assert code == 2 and "at step 3; --steps 2 would end at or before it" in err
    code, _, err = run_cli(["train", "--out", str(out), "--resume"], capsys)
    assert code == 2 and "has finished its 3 steps" in err
    assert snapshot(out) == before


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    from dikkat.training.trainer import train

    out = tmp_path_factory.mktemp("bpe") / "run"
    spec = TaskSpec(**{**SPEC.to_json(), "tokenizer": "bpe", "vocab_size": 300})
    config = TrainConfig(steps=2, batch_size=2, warmup=1, eval_every=0, eval_batches=1)
    train(spec, config, out, progress=False)
    return out


def test_a_run_without_its_tokenizer_never_falls_back_to_bytes(bpe_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(bpe_run, out)
    tokenizer = runs.checkpoint_dir(out) / "tokenizer.json"
    good = tokenizer.read_bytes()
    tokenizer.unlink()
    before = snapshot(out)
    code, text, err = run_cli(["generate", str(out), "def ", "-n", "3"], capsys)
    assert code == 2 and "tokenizer.json is missing" in err and text == ""
    code, text, err = run_cli(["generate", str(out), "def ", "-n", "3", "--no-verify"], capsys)
    assert code == 2 and "has no tokenizer" in err and text == ""
    code, _, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "3"], capsys)
    assert code == 2 and "tokenizer.json is missing" in err
    code, _, err = run_cli(
        ["train", "--out", str(out), "--resume", "--steps", "3", "--no-verify"], capsys
    )
    assert code == 2 and "has no tokenizer" in err
    assert snapshot(out) == before  # still a BPE run, nothing rewritten
    tokenizer.write_bytes(b'{"version": "1.0", "model": {"type": "BP')  # corrupt
    code, _, err = run_cli(["generate", str(out), "def ", "-n", "3", "--no-verify"], capsys)
    assert code == 2 and "is not a readable tokenizer file" in err
    tokenizer.write_bytes(good)
    code, text, err = run_cli(["generate", str(out), "def ", "-n", "3"], capsys)
    assert code == 0, err


def test_damaged_weights_are_found_wherever_a_run_is_loaded(bpe_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(bpe_run, out)
    weights = runs.checkpoint_dir(out) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10  # one bit of one weight: safetensors still parses the file
    weights.write_bytes(bytes(data))
    code, _, err = run_cli(["generate", str(out), "def ", "-n", "3"], capsys)
    assert code == 2 and "model.safetensors is damaged" in err
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged"):
        GPT.load(out)
    code, _, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "3"], capsys)
    assert code == 2 and "model.safetensors is damaged" in err
    code, _, err = run_cli(["generate", str(out), "def ", "-n", "3", "--no-verify"], capsys)
    assert code == 0, err  # the opt-out
    state = runs.checkpoint_dir(out) / STATE_FILE
    weights.write_bytes(bytes(data[:-3]) + bytes([data[-3] ^ 0x10]) + bytes(data[-2:]))
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"trainer_state\.pt is damaged"):
        resume_trainer(out, steps=3)


def test_a_checkpoint_without_its_manifest_is_refused_like_a_damaged_one(bpe_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(bpe_run, out)
    manifest = runs.checkpoint_dir(out) / runs.MANIFEST_FILE
    manifest.unlink()
    before = snapshot(out)
    message = f"{manifest} is missing, so the checkpoint's files cannot be checked"
    code, _, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "3"], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, text, err = run_cli(["generate", str(out), "def ", "-n", "3"], capsys)
    assert code == 2 and message in err and text == ""
    with pytest.raises(FileNotFoundError, match=r"manifest\.json is missing"):
        GPT.load(out)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json is missing"):
        resume_trainer(out, steps=3)
    assert snapshot(out) == before  # nothing trained, nothing committed
    assert isinstance(GPT.load(out, verify=False), GPT)  # the explicit way out
    code, _, err = run_cli(
        ["train", "--out", str(out), "--resume", "--steps", "3", "--no-verify", "--no-progress"],
        capsys,
    )
    assert code == 0, err
    assert runs.verify_checkpoint(runs.checkpoint_dir(out))  # the new checkpoint has one


def test_a_translator_run_is_verified_too(tmp_path, capsys):
    out = tmp_path / "tr"
    code, _, err = run_cli(
        [
            "train",
            "--task",
            "translate",
            "--steps",
            "1",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--layers",
            "1",
            "--batch-size",
            "2",
            "--eval-every",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    config = runs.checkpoint_dir(out) / "config.json"
    config.write_text(config.read_text().replace('"norm_eps": 1e-05', '"norm_eps": 1e-06'))
    code, _, err = run_cli(["translate", str(out), "12"], capsys)
    assert code == 2 and "config.json is damaged" in err  # an edit is a change of the run


# --- sizes and divergence -------------------------------------------------------------------


def test_a_model_too_big_for_the_machine_is_refused_before_allocating(tmp_path, capsys):
    code, _, err = run_cli(
        [
            "train",
            "--task",
            "lm",
            "--d-model",
            "65536",
            "--layers",
            "64",
            "--heads",
            "64",
            "--out",
            str(tmp_path / "big"),
            "--data",
            str(TEXT),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 2 and "parameters needs" in err and "GiB to train" in err, err
    assert not (tmp_path / "big").exists()


def test_a_max_len_too_large_for_memory_is_refused_before_allocating(tmp_path, capsys):
    folder = tmp_path / "model"
    GPT(GPTConfig.preset("tiny", max_len=16)).save(folder)
    config = folder / "config.json"
    meta = json.loads(config.read_text())
    meta["config"]["max_len"] = 10**12  # learned positions: max_len × d_model floats
    config.write_text(json.dumps(meta))
    d = meta["config"]["d_model"]
    table = (10**12 - 1) * d * 4 / 2**30  # the fp32 table's rows beyond one
    cause = f"max_len 1,000,000,000,000 alone takes {table:,.1f} GiB of it"
    with pytest.raises(ValueError, match=re.escape(f"GiB available; {cause}") + "$"):
        GPT.load(folder)  # not the allocator's RuntimeError
    code, _, err = run_cli(["generate", str(folder), "def ", "-n", "2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"error: {config}: a GPT of this config needs " in err and cause in err


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(
    task, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    code, _, err = train_cli(capsys, out, "--lr", "1e30", "--save-every", "1", "--steps", "5")
    assert code == 1, err
    assert "training diverged at step 2" in err and "the last checkpoint (step 1)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    resumed = resume_trainer(out, steps=6)  # the checkpoint is whole, and its weights finite
    assert resumed.step == 1
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())
    nan = torch.tensor(float("nan"), requires_grad=True)
    monkeypatch.setattr(task, "loss", lambda model, batch: (nan, 1))
    t = Trainer(task, CONFIG)  # in the API: the exception, before the step is applied
    with pytest.raises(DivergedError, match="the loss is nan"):
        t.train(progress=False)
    assert t.step == 0


# --- runs of an older dikkat -----------------------------------------------------------------


def test_a_flat_run_of_an_older_dikkat_still_resumes(task, tmp_path):
    """Before checkpoints had folders, a run kept its files flat beside task.json, and the
    trainer state recorded the weights' SHA-256; such a run resumes, and its next save moves it
    to the new layout."""
    out = tmp_path / "old"
    t = Trainer(task, CONFIG, out)
    t.train(progress=False, until=2)
    folder = runs.checkpoint_dir(out)
    for f in folder.iterdir():
        if f.name != runs.MANIFEST_FILE:
            shutil.copy(f, out / f.name)
    shutil.rmtree(folder)
    (out / runs.RUN_FILE).unlink()
    state = torch.load(out / STATE_FILE, weights_only=True)
    from dikkat.files import sha256

    state["weights_sha256"] = sha256(out / "model.safetensors")
    torch.save(state, out / STATE_FILE)
    assert runs.folder_kind(out) == "run" and (out / TASK_FILE).is_file()
    resumed = resume_trainer(out)
    assert resumed.step == 2
    resumed.train(progress=False)
    assert (out / runs.RUN_FILE).is_file() and not (out / TASK_FILE).exists()
    assert resume_trainer(out, steps=5).step == 4
