"""The training commands: train, --resume, translate, leak-demo, demo; bad arguments."""

import json

import pytest

from dikkat.runs import RUN_FILE, checkpoint_dir
from dikkat.training.trainer import LOG_FILE, PLOT_FILE, STATE_FILE
from helpers import run_cli

TINY = [
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--max-bytes",
    "100000",
    "--batch-size",
    "4",
    "--eval-every",
    "0",
    "--no-progress",
]


def test_train_then_resume_extends_the_run(tmp_path, capsys):
    out = tmp_path / "gpt"
    code, text, _ = run_cli(
        ["train", "--task", "lm", "--steps", "4", "--out", str(out), *TINY], capsys
    )
    assert code == 0 and "validation loss" in text
    for name in (RUN_FILE, LOG_FILE, PLOT_FILE):
        assert (out / name).is_file()
    for name in ("model.safetensors", "config.json", STATE_FILE):
        assert (checkpoint_dir(out) / name).is_file()
    code, _, err = run_cli(["train", "--steps", "4", "--out", str(out), *TINY], capsys)
    assert code == 2 and "already holds a training run" in err  # never replaced by accident
    code, text, _ = run_cli(
        ["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"], capsys
    )
    assert code == 0 and "resuming" in text
    steps = [json.loads(x)["step"] for x in (out / LOG_FILE).read_text().splitlines()]
    assert max(steps) == 6
    code, text, _ = run_cli(["generate", str(out), "def ", "-n", "5"], capsys)
    assert code == 0 and text.startswith("def ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--task", "mlm", "--kv-heads", "2"], "--kv-heads does not apply to --task mlm"),
        (["train", "--task", "chat"], "invalid choice"),
        (["train", "--steps", "0"], "expected a positive integer"),
        (["train", "--lr", "-1"], "expected a positive number"),
        (["train", "--resume", "--out", "/no/such/run"], "not a dikkat training run"),
        (
            ["train", "--data", "/no/such/file", "--steps", "1", "--out", "/tmp/x-dikkat-none"],
            "does not exist",
        ),
        (["translate", "/no/such/ckpt", "12"], "/no/such/ckpt does not exist"),
    ],
)
def test_bad_arguments_give_one_line(argv, message, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err
    assert err.strip().count("\n") == 0


def test_translate_command(tmp_path, capsys):
    out = tmp_path / "tr"
    code, _, _ = run_cli(
        [
            "train",
            "--task",
            "translate",
            "--steps",
            "2",
            "--d-model",
            "32",
            "--heads",
            "2",
            "--layers",
            "1",
            "--batch-size",
            "4",
            "--eval-every",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0
    code, text, _ = run_cli(["translate", str(out), "4721", "1,000"], capsys)
    assert code == 0
    lines = text.strip().splitlines()
    assert lines[0].split("→")[0].strip() == "4721" and lines[1].split("→")[0].strip() == "1000"
    code, _, err = run_cli(["translate", str(out), "12a"], capsys)
    assert code == 2 and "not a whole number" in err


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    code, text, _ = run_cli(
        [
            "demo",
            "--steps",
            "3",
            "--leak-steps",
            "3",
            "--sample-tokens",
            "8",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0
    assert "validation loss" in text and "KV cache" in text and "causal val loss" in text
    assert (out / PLOT_FILE).is_file() and (checkpoint_dir(out) / "model.safetensors").is_file()


def test_demo_never_deletes_a_folder_that_is_not_a_run(tmp_path, capsys):
    keep = tmp_path / "precious.txt"
    keep.write_text("do not delete")
    code, _, err = run_cli(
        ["demo", "--steps", "1", "--out", str(tmp_path), "--no-progress"], capsys
    )
    assert code == 2 and "files that dikkat did not write" in err
    assert keep.read_text() == "do not delete"
