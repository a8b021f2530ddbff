"""The digits task: split, 1-NN baseline, shifts, a short training run, resume, and the CLI."""

import json

import pytest
import torch

from dikkat.cli import build_parser
from dikkat.cli.train import with_recipe
from dikkat.runs import checkpoint_dir
from dikkat.tasks import TaskSpec, build_task, task_names
from dikkat.tasks.digits import (
    DIGITS_TRAINING,
    DigitsTask,
    every_shift,
    load_digits_split,
    nearest_neighbour_accuracy,
    random_shift,
    stratified_split,
)
from dikkat.text import NoTokenizer
from dikkat.training.trainer import TASK_FILE, TrainConfig, Trainer, resume_trainer
from helpers import run_cli

TINY = TaskSpec(task="digits", preset="tiny")


@pytest.fixture(scope="module")
def split():
    return load_digits_split(seed=0)


def test_split_is_stratified_disjoint_and_seeded(split):
    n_train, n_test = len(split.train_y), len(split.test_y)
    assert (n_train, n_test) == (1437, 360)  # 20 % of 1,797, rounded up as scikit-learn does
    all_y = torch.cat([split.train_y, split.test_y])
    for k in range(10):
        share = int((split.test_y == k).sum()) / int((all_y == k).sum())
        assert abs(share - 0.2) < 0.02, (k, share)
    labels = torch.arange(100) % 4
    train, test = stratified_split(labels, 0.25, seed=1)
    assert sorted(torch.cat([train, test]).tolist()) == list(range(100))  # disjoint, complete
    counts = torch.bincount(labels[test]).tolist()  # 25 per class × 0.25 = 6.25
    assert sum(counts) == 25 and all(c in (6, 7) for c in counts), counts
    assert torch.equal(stratified_split(labels, 0.25, seed=1)[1], test)
    assert not torch.equal(stratified_split(labels, 0.25, seed=2)[1], test)
    assert float(split.train_x.max()) == 1.0 and float(split.train_x.min()) == 0.0
    with pytest.raises(ValueError, match="test_fraction must be in"):
        stratified_split(labels, 1.0, seed=0)


def test_nearest_neighbour_is_computed(split):
    # two training points; each test point is nearer one of them
    train_x = torch.tensor([[0.0, 0.0], [10.0, 10.0]])
    train_y = torch.tensor([3, 7])
    test_x = torch.tensor([[1.0, 0.0], [9.0, 9.0], [6.0, 6.0]])
    assert nearest_neighbour_accuracy(train_x, train_y, test_x, torch.tensor([3, 7, 7])) == 1.0
    assert nearest_neighbour_accuracy(train_x, train_y, test_x, torch.tensor([3, 3, 3])) == 1 / 3
    # on the digits: the same answer as a plain loop over a few test images
    ours = nearest_neighbour_accuracy(split.train_x, split.train_y, split.test_x, split.test_y)
    a = split.train_x.flatten(1)
    for i in range(5):
        j = int(((a - split.test_x[i].flatten()) ** 2).sum(1).argmin())
        hit = nearest_neighbour_accuracy(
            split.train_x, split.train_y, split.test_x[i : i + 1], split.test_y[i : i + 1]
        )
        assert hit == float(split.train_y[j] == split.test_y[i])
    assert 0.95 < ours < 1.0


def test_random_shift_moves_each_image_by_at_most_one_pixel():
    images = torch.rand(64, 2, 5, 5) + 0.1  # no zeros inside, so a shift is recognisable
    out = random_shift(images, torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1))
    seen = set()
    for b in range(len(images)):
        found = [
            (dy, dx)
            for dy in range(3)
            for dx in range(3)
            if torch.equal(out[b], padded[b, :, dy : dy + 5, dx : dx + 5])
        ]
        assert len(found) == 1, b
        seen.add(found[0])
    assert len(seen) == 9  # every offset occurs in 64 draws


def test_every_shift_and_the_shift_averaged_accuracy():
    images = torch.rand(3, 1, 8, 8)
    views = every_shift(images)
    assert views.shape == (9, 3, 1, 8, 8)
    assert torch.equal(views[4], images)  # dy = dx = 0
    assert torch.equal(views[0, :, :, 1:, 1:], images[:, :, :-1, :-1])  # moved down and right
    task = build_task(TINY)
    model = task.model.eval()
    x, y = task.data.test_x, task.data.test_y
    with torch.no_grad():
        probs = sum(model(v).softmax(-1) for v in every_shift(x)) / 9
    expected = float((probs.argmax(-1) == y).double().mean())
    assert task.accuracy(model, average_shifts=True) == pytest.approx(expected)


def test_task_batches_tokens_and_tokenizer(tmp_path):
    task = build_task(TINY)
    assert isinstance(task, DigitsTask) and "digits" in task_names()
    g = torch.Generator().manual_seed(0)
    b = task.batch("train", g, 16)
    assert b["images"].shape == (16, 1, 8, 8) and b["labels"].shape == (16,)
    assert task.tokens_in(b) == 16 * 5  # 4 patches of 4×4 and the class token per image
    v = task.batch("val", g, 1000)
    assert len(v["labels"]) == 360  # a batch never repeats an image
    assert task.baseline == pytest.approx(
        nearest_neighbour_accuracy(
            task.data.train_x, task.data.train_y, task.data.test_x, task.data.test_y
        )
    )
    NoTokenizer().save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"type": "none"}
    with pytest.raises(ValueError, match="8×8, grey, in 10 classes"):
        build_task(TaskSpec(task="digits", preset="vit-base-16"))


def test_short_training_beats_chance_by_far():
    config = TrainConfig(steps=300, batch_size=64, lr=3e-3, warmup=10, eval_every=0, log_every=50)
    task = build_task(TINY)
    # the baselines, measured on the same held-out digits: the untrained model, and always
    # answering the commonest class (chance, ≈ 0.1 for ten balanced classes)
    untrained = task.accuracy(task.model)
    commonest = float(task.data.test_y.bincount().max()) / len(task.data.test_y)
    assert untrained < 0.3 and commonest < 0.15, (untrained, commonest)
    result = Trainer(task, config).train(progress=False)
    for name in ("test_accuracy", "test_accuracy_shift_averaged"):
        accuracy = result.metrics[name]
        assert accuracy > 0.6 and accuracy > max(untrained, commonest) + 0.4, (
            f"{name} {accuracy:.3f}: untrained {untrained:.3f}, commonest class {commonest:.3f}"
        )
    assert result.metrics["nearest_neighbour_accuracy"] > 0.95


def test_resume_continues_exactly(tmp_path):
    config = TrainConfig(steps=30, batch_size=32, lr=3e-3, warmup=5, eval_every=0, log_every=5)
    whole = Trainer(build_task(TINY), config)
    result = whole.train(progress=False)
    out = tmp_path / "run"
    Trainer(build_task(TINY), config, out).train(progress=False, until=12)
    resumed = resume_trainer(out)
    assert resumed.step == 12
    again = resumed.train(progress=False)
    assert again.metrics["test_accuracy"] == pytest.approx(result.metrics["test_accuracy"])
    theirs = resumed.model.state_dict()
    for name, p in whole.model.state_dict().items():
        torch.testing.assert_close(theirs[name], p, msg=name)


def test_cli_defaults_are_the_recipe_for_digits_only():
    parser = build_parser()
    digits = with_recipe(parser.parse_args(["train", "--task", "digits"]))
    for name, value in DIGITS_TRAINING.items():
        assert getattr(digits, name) == value
    lm = with_recipe(parser.parse_args(["train"]))  # --task left out: lm
    assert lm.task == "lm"
    assert (lm.preset, lm.steps, lm.batch_size, lm.lr, lm.warmup) == ("tiny", 1000, 32, 1e-3, 100)
    mine = with_recipe(parser.parse_args(["train", "--task", "digits", "--batch-size", "8"]))
    assert mine.batch_size == 8 and mine.steps == DIGITS_TRAINING["steps"]


def test_cli_train_resume_and_attention_png(tmp_path, capsys):
    out = tmp_path / "digits"
    small = ["--preset", "tiny", "--batch-size", "16", "--eval-every", "0", "--no-progress"]
    code, text, err = run_cli(
        ["train", "--task", "digits", "--steps", "3", "--out", str(out), *small], capsys
    )
    assert code == 0, err
    assert "test_accuracy" in text and "nearest_neighbour_accuracy: 0.9833" in text
    assert "1-nearest-neighbour on the same split: 98.3%" in text
    task_json = checkpoint_dir(out) / TASK_FILE
    assert json.loads(task_json.read_text())["task"]["task"] == "digits"
    code, text, err = run_cli(
        ["train", "--out", str(out), "--resume", "--steps", "5", "--no-progress"], capsys
    )
    assert code == 0 and "resuming" in text, err

    png = tmp_path / "maps.png"
    code, text, err = run_cli(
        ["vit-attention", str(out), "--out", str(png), "--count", "2"], capsys
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heads = tmp_path / "heads.png"
    code, _, err = run_cli(["vit-attention", str(out), "--out", str(heads), "--layer", "0"], capsys)
    assert code == 0 and heads.read_bytes()[:4] == b"\x89PNG", err

    code, _, err = run_cli(["vit-attention", str(out), "--out", str(png), "--layer", "4"], capsys)
    assert code == 2 and err.strip() == "dikkat: error: --layer 4: the model has layers 0 … 0"
    code, _, err = run_cli(["vit-attention", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "nowhere does not exist" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["vit-attention", str(out), "--count", "0"], capsys)
    assert code == 2 and "expected a positive integer" in err
