"""A command given a folder of the wrong kind says what the folder holds and which command reads
it, in one line with exit status 2 — never a constructor's TypeError or a traceback."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dikkat import runs
from dikkat.models import BERT, GPT, BERTConfig, GPTConfig
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import TrainConfig, Trainer
from helpers import run_cli

SMALL = {"d_model": 16, "n_heads": 2}
# task → (the model class its run holds, the command that reads it, that command's noun)
KINDS = {
    "lm": ("GPT", "generate", "a GPT"),
    "mlm": ("BERT", "fill-mask", "a masked-LM BERT"),
    "translate": ("Seq2Seq", "translate", "a translator"),
    "digits": ("ViT", "vit-attention", "a digits ViT"),
    "shapes": ("DETR", "detect", "a shapes DETR"),
}


def argv_of(command: str, folder: Path, png: Path) -> list[str]:
    """A valid command line of ``command`` on ``folder``, but for the folder."""
    return {
        "generate": ["generate", str(folder), "def ", "-n", "2"],
        "fill-mask": ["fill-mask", str(folder), "a [MASK]"],
        "translate": ["translate", str(folder), "12"],
        "vit-attention": ["vit-attention", str(folder), "--out", str(png), "--count", "1"],
        "detect": ["detect", str(folder), "--out", str(png), "--count", "1"],
    }[command]


@pytest.fixture(scope="module")
def run_of(tmp_path_factory):
    """task → a run folder of that task at step 0: a real run (run.json, checkpoint, task.json),
    written by the Trainer without training, which these tests do not need."""
    root = tmp_path_factory.mktemp("runs")
    text = root / "corpus.txt"
    text.write_text(Path(json.__file__).read_text())
    specs = {
        "lm": TaskSpec(
            task="lm",
            seq_len=16,
            data=str(text),
            model_overrides={**SMALL, "n_layers": 1, "max_len": 16},
        ),
        "mlm": TaskSpec(
            task="mlm",
            seq_len=16,
            data=str(text),
            model_overrides={**SMALL, "n_layers": 1, "max_len": 16},
        ),
        "translate": TaskSpec(
            task="translate",
            model_overrides={**SMALL, "n_encoder_layers": 1, "n_decoder_layers": 1},
        ),
        "digits": TaskSpec(task="digits", preset="tiny", model_overrides={**SMALL, "n_layers": 1}),
        "shapes": TaskSpec(task="shapes", model_overrides={**SMALL, "n_layers": 1}),
    }
    runs = {}
    for name, spec in specs.items():
        runs[name] = root / name
        Trainer(build_task(spec), TrainConfig(steps=1, batch_size=2), runs[name]).save()
    return runs


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("dikkat: error: "), err
    return err.strip().removeprefix("dikkat: error: ")


def test_each_command_reads_its_own_kind_of_run(run_of, tmp_path, capsys):
    for task, (_, command, _) in KINDS.items():
        code, _, err = run_cli(argv_of(command, run_of[task], tmp_path / "x.png"), capsys)
        assert code == 0, (command, err)


WRONG = [
    (task, command)
    for task in KINDS
    for _, command, _ in KINDS.values()
    if KINDS[task][1] != command
]


@pytest.mark.parametrize("task, command", WRONG)
def test_a_run_of_another_kind_is_named_with_the_command_that_reads_it(
    task, command, run_of, tmp_path, capsys
):
    folder = run_of[task]
    model, reader, _ = KINDS[task]
    noun = next(n for _, c, n in KINDS.values() if c == command)
    code, _, err = run_cli(argv_of(command, folder, tmp_path / "x.png"), capsys)
    assert one_line_error(code, err) == (
        f"{folder} holds a {task!r} run (a {model}), not {noun}: use dikkat {reader} {folder}"
    )
    assert not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """A GPT and a BERT saved with save(): model folders, not runs."""
    root = tmp_path_factory.mktemp("models")
    GPT(GPTConfig.preset("tiny", max_len=16)).save(root / "gpt")
    BERT(BERTConfig.preset("tiny", max_len=16)).save(root / "bert")
    return root


@pytest.mark.parametrize("command", ["fill-mask", "translate", "vit-attention", "detect"])
def test_a_saved_gpt_is_not_read_as_another_model(command, saved_models, tmp_path, capsys):
    folder = saved_models / "gpt"
    noun = next(n for _, c, n in KINDS.values() if c == command)
    code, _, err = run_cli(argv_of(command, folder, tmp_path / "x.png"), capsys)
    assert one_line_error(code, err) == (
        f"{folder} holds a saved GPT, not {noun}: use dikkat generate {folder}"
    )


def test_a_saved_bert_is_not_a_gpt(saved_models, tmp_path, capsys):
    folder = saved_models / "bert"
    code, _, err = run_cli(argv_of("generate", folder, tmp_path / "x.png"), capsys)
    assert one_line_error(code, err) == (
        f"{folder} holds a saved BERT, not a GPT: use dikkat fill-mask {folder}"
    )


def test_a_hugging_face_gpt2_folder_points_to_hf_gpt2(tmp_path, capsys):
    import transformers

    transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path)
    code, _, err = run_cli(["generate", str(tmp_path), "ab"], capsys)
    assert one_line_error(code, err) == (
        f"{tmp_path} holds a Hugging Face 'gpt2' model, not a GPT: "
        f"use dikkat generate --hf-gpt2 {tmp_path}"
    )


def test_a_damaged_or_missing_config_json_is_named_as_such(run_of, saved_models, tmp_path, capsys):
    """Not "a config.json that names no dikkat model": the file is damaged or gone, and a run's
    manifest says how — with --no-verify too (no model can be read without it)."""
    run = tmp_path / "run"
    shutil.copytree(run_of["lm"], run)
    config = runs.checkpoint_dir(run) / "config.json"
    size = config.stat().st_size
    config.write_bytes(config.read_bytes()[: size // 2])
    for flags in ([], ["--no-verify"]):
        code, _, err = run_cli([*argv_of("generate", run, tmp_path / "x.png"), *flags], capsys)
        assert one_line_error(code, err) == (
            f"{config} is damaged: {size // 2:,} bytes where {size:,} were written "
            "(truncated or replaced)"
        )
    config.unlink()
    code, _, err = run_cli(["train", "--resume", "--out", str(run), "--no-verify"], capsys)
    assert one_line_error(code, err) == f"{config} is missing (its checkpoint lists it)"
    model = tmp_path / "model"
    shutil.copytree(saved_models / "gpt", model)
    (model / "config.json").write_text('{"model": "GP')
    code, _, err = run_cli(argv_of("generate", model, tmp_path / "x.png"), capsys)
    assert one_line_error(code, err) == (
        f"{model / 'config.json'} is damaged: it is not the JSON object of a model's config"
    )


@pytest.mark.parametrize("command", [c for _, c, _ in KINDS.values()])
def test_a_folder_that_is_no_run_says_so(command, tmp_path, capsys):
    png = tmp_path / "x.png"
    empty, other, missing, file = (tmp_path / n for n in ("empty", "other", "missing", "f.txt"))
    empty.mkdir()
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    file.write_text("a file")
    expected = {
        empty: f"{empty} is an empty folder, not a run or model folder",
        other: f"{other} is not a run or model folder: it holds files that dikkat did not "
        "write, and no run.json or config.json",
        missing: f"{missing} does not exist (expected a run or model folder)",
        file: f"{file} is a file, not a run or model folder",
    }
    for folder, message in expected.items():
        code, _, err = run_cli(argv_of(command, folder, png), capsys)
        assert one_line_error(code, err) == message
    assert (other / "notes.txt").read_text() == "mine" and not png.exists()


def test_resume_refuses_a_saved_model_and_a_run_of_another_task(run_of, saved_models, capsys):
    gpt = saved_models / "gpt"
    code, _, err = run_cli(["train", "--resume", "--out", str(gpt), "--no-progress"], capsys)
    assert one_line_error(code, err) == (
        f"{gpt} holds a saved GPT, not a training run (--resume continues one): "
        f"use dikkat generate {gpt}"
    )
    for task in KINDS:
        run = run_of[task]
        other = "lm" if task != "lm" else "translate"
        code, _, err = run_cli(
            ["train", "--task", other, "--resume", "--out", str(run), "--no-progress"], capsys
        )
        model = KINDS[task][0]
        assert one_line_error(code, err) == (
            f"{run} holds a {task!r} run (a {model}), not a {other!r} run: --resume continues "
            f"the run's own task (leave out --task, or give --task {task})"
        )
        assert json.loads((run / "run.json").read_text())["step"] == 0  # nothing written


def test_resume_with_the_runs_own_task_continues(run_of, capsys):
    run = run_of["lm"]
    argv = ["train", "--task", "lm", "--resume", "--out", str(run), "--no-progress"]
    code, text, err = run_cli([*argv, "--device", "cpu"], capsys)
    assert code == 0 and "resuming" in text and "at step 0 of 1" in text, err
    assert json.loads((run / "run.json").read_text())["step"] == 1


# every command that runs a model, on a folder it accepts
DEVICE_COMMANDS = [
    *[(command, task) for task, (_, command, _) in KINDS.items()],
    ("embed", None),
    ("similar", None),
    ("train", None),
    ("demo", None),
    ("leak-demo", None),
]


def device_argv(command: str, task: str | None, run_of, tmp_path: Path) -> list[str]:
    if task is not None:
        return argv_of(command, run_of[task], tmp_path / "x.png")
    return {
        "embed": ["embed", "a cat"],
        "similar": ["similar", "a cat", "a kitten"],
        "train": ["train", "--steps", "1", "--out", str(tmp_path / "new"), "--no-progress"],
        "demo": ["demo", "--steps", "1", "--out", str(tmp_path / "demo"), "--no-progress"],
        "leak-demo": ["leak-demo", "--steps", "1", "--no-progress"],
    }[command]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("command, task", DEVICE_COMMANDS)
def test_device_cuda_without_cuda_is_one_line(command, task, run_of, tmp_path, capsys):
    argv = device_argv(command, task, run_of, tmp_path)
    code, _, err = run_cli([*argv, "--device", "cuda"], capsys)
    assert one_line_error(code, err) == (
        f"--device cuda: CUDA is not available (torch {torch.__version__})"
    )
    code, _, err = run_cli([*argv, "--device", "nope"], capsys)
    assert "dikkat: error: --device 'nope' is not a device torch knows" in err and code == 2
    assert not (tmp_path / "x.png").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["vit-attention", "detect"])
def test_vision_commands_run_on_the_device_named(command, run_of, tmp_path, capsys):
    task = next(t for t, (_, c, _) in KINDS.items() if c == command)
    argv = argv_of(command, run_of[task], tmp_path / "x.png")
    code, text, err = run_cli([*argv, "--device", "cpu"], capsys)
    assert code == 0 and str(tmp_path / "x.png") in text, err
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
