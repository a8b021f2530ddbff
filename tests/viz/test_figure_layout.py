"""Every figure dikkat draws keeps its text on the canvas and its legend off the data
(``figure_checks.check_layout``), for narrow and wide inputs alike."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest

from dikkat.viz.curves import draw_losses
from dikkat.viz.heatmaps import draw_alignment, draw_focus, draw_grid
from dikkat.viz.maps import MEAN_OF_HEADS, AttentionMaps
from dikkat.viz.overlay import draw_image_attention, draw_importance
from figure_checks import check_layout, layout_problems

WORDS = "[CLS] the animal didn ' t cross the street because it was too tired . [SEP]"
SENTENCE = tuple(WORDS.split(" "))
TOKENS = {
    "three": ("a", "b", "c"),
    "a sentence": SENTENCE,
    "300": tuple(f"t{i}" for i in range(300)),
}
PATCHES = ("[CLS]", *(f"({r},{c})" for r in range(4) for c in range(4)))


def _maps(L: int, H: int, keys, queries=None, kind="self", layers=None, heads=None):
    queries = keys if queries is None else queries
    rng = np.random.default_rng(0)
    w = rng.random((L, H, len(queries), len(keys))).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    return AttentionMaps(
        queries=tuple(queries), keys=tuple(keys),
        layers=tuple(layers or (f"layer {i}" for i in range(L))), heads=tuple(heads or range(H)),
        weights=w, kind=kind, title="all-MiniLM-L6-v2 on a sentence",
    )  # fmt: skip


def _importance(tokens, title: str):
    n = len(tokens)
    rng = np.random.default_rng(1)
    attention = {"layer 5 (mean of heads)": rng.random(n), "rollout to layer 5": rng.random(n)}
    importance = {"leave-one-out": rng.random(n), "gradient × input": rng.random(n)}
    rho = {a: {m: 0.12 for m in importance} for a in attention}
    return draw_importance(tokens, importance, attention, rho, title=title)


NEXT = "|Δ log p| of the next token ('c') when the token is removed"
FIGURES = {
    **{f"grid, {n} tokens": lambda t=t: draw_grid(_maps(2, 3, t)) for n, t in TOKENS.items()},
    **{
        f"rollout grid, {n} tokens": lambda t=t: draw_grid(
            _maps(
                2,
                1,
                t,
                layers=("rollout to layer 0", "rollout to layer 11"),
                heads=(MEAN_OF_HEADS,),
            )
        )
        for n, t in TOKENS.items()
    },
    "grid, 6 layers × 12 heads": lambda: draw_grid(_maps(6, 12, SENTENCE)),
    **{f"focus, {n} tokens": lambda t=t: draw_focus(_maps(1, 1, t), 1) for n, t in TOKENS.items()},
    "focus, 3 layers × 12 heads": lambda: draw_focus(_maps(3, 12, SENTENCE), 10),
    "alignment": lambda: draw_alignment(
        _maps(
            2,
            2,
            ("4", "7", "2", "1"),
            ("four", "thousand", "seven", "hundred", "twenty", "one", "</s>"),
            kind="cross",
        )
    ),
    "alignment of one source token": lambda: draw_alignment(
        _maps(1, 2, ("4",), ("four", "</s>"), kind="cross")
    ),
    "image": lambda: draw_image_attention(
        _maps(4, 4, PATCHES, ("[CLS]",), kind="image"), np.zeros((8, 8))
    ),
    "image rollout": lambda: draw_image_attention(
        _maps(
            1,
            1,
            PATCHES,
            ("[CLS]",),
            kind="image",
            layers=("rollout to layer 3",),
            heads=(MEAN_OF_HEADS,),
        ),
        np.zeros((8, 8)),
    ),
    "faithfulness, three tokens": lambda: _importance(("a", "b", "c"), f"'b': {NEXT}"),
    "faithfulness, a sentence": lambda: _importance(SENTENCE, "'it': 1 − cos(h, h masked)"),
    "faithfulness, 60 tokens": lambda: _importance(tuple(f"t{i}" for i in range(60)), NEXT),
    "loss curves": lambda: draw_losses(
        [{"step": s, "loss": 5 - s / 100} for s in range(1, 300)] + [{"step": 300, "val_loss": 2}],
        title="lm · tiny",
    ),
    "loss curves, loss going up": lambda: draw_losses(
        [{"step": s, "loss": 1 + s / 100} for s in range(1, 300)], title="lm · tiny"
    ),
}


@pytest.mark.parametrize("name", FIGURES)
def test_nothing_is_clipped_and_no_legend_covers_data(name):
    fig = FIGURES[name]()
    try:
        check_layout(fig)
    finally:
        plt.close(fig)


def test_the_check_sees_a_clipped_title_and_a_legend_on_the_bars():
    fig, ax = plt.subplots(figsize=(2, 2), dpi=100)
    ax.bar([0, 1, 2], [1, 1, 1], label="bars")
    ax.legend(loc="center")
    fig.suptitle("a title far too long to fit on a canvas two inches wide")
    problems = layout_problems(fig)
    plt.close(fig)
    assert any("leaves the 200 × 200 px canvas" in p for p in problems), problems
    assert any("the legend covers" in p for p in problems), problems
