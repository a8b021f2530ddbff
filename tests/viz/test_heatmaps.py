"""The attention figures, read back from the matplotlib Figure before it is saved."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from dikkat.viz.figure import save_png
from dikkat.viz.heatmaps import draw_alignment, draw_focus, draw_grid
from dikkat.viz.maps import AttentionMaps
from dikkat.viz.overlay import draw_image_attention, draw_importance


def _maps(L: int = 2, H: int = 3, tokens: tuple[str, ...] = ("[CLS]", "it", "$5", "[SEP]"),
          kind: str = "self", queries: tuple[str, ...] | None = None) -> AttentionMaps:  # fmt: skip
    queries = tokens if queries is None else queries
    rng = np.random.default_rng(0)
    w = rng.random((L, H, len(queries), len(tokens))).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    return AttentionMaps(
        queries=queries, keys=tokens, layers=tuple(f"layer {i}" for i in range(L)),
        heads=tuple(range(H)), weights=w, kind=kind, title="a title",
    )  # fmt: skip


def _labels(ticks) -> list[str]:
    return [t.get_text().replace(r"\$", "$") for t in ticks]


def test_grid_has_a_panel_per_layer_and_head_labelled_with_the_tokens(tmp_path):
    m = _maps()
    fig = draw_grid(m)
    axes = np.array(fig.axes).reshape(2, 3)
    assert len(fig.axes) == 2 * 3
    assert _labels(axes[-1, 0].get_xticklabels()) == list(m.keys)
    assert _labels(axes[0, 0].get_yticklabels()) == list(m.queries)
    assert axes[0, 1].get_yticklabels() == [] and axes[0, 0].get_xticklabels() == []
    assert axes[1, 2].get_title() == "layer 1 · head 2"
    assert fig._suptitle.get_text().startswith("a title")
    path = save_png(fig, tmp_path / "grid.png")
    pixels = matplotlib.image.imread(path)
    assert pixels.std() > 0.05  # not blank


def test_long_inputs_thin_the_labels_to_what_fits():
    tokens = tuple(f"t{i}" for i in range(300))
    m = _maps(L=1, H=1, tokens=tokens, queries=tokens[-1:])
    fig = draw_grid(m)
    ticks = fig.axes[0].get_xticks()
    labels = _labels(fig.axes[0].get_xticklabels())
    assert 5 < len(labels) < 100
    assert labels == [tokens[int(i)] for i in ticks]  # each label sits on its own token
    plt.close(fig)


def test_focus_has_a_line_per_head_in_each_layer():
    m = _maps(L=3, H=4)
    fig = draw_focus(m, 1)
    assert len(fig.axes) == 3
    assert fig.axes[0].images[0].get_array().shape == (4, 4)
    np.testing.assert_array_equal(fig.axes[2].images[0].get_array(), m.weights[2, :, 1])
    assert _labels(fig.axes[0].get_yticklabels()) == [f"head {h}" for h in range(4)]
    assert "'it'" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="row must be an index"):
        draw_focus(m, 4)
    plt.close("all")


def test_a_deep_model_s_focus_wraps_its_layers_into_rows():
    """30 layers: rows of six panels (not a strip 30 panels long), each layer's in order."""
    m = _maps(L=30, H=2)
    fig = draw_focus(m, 1)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == list(m.layers)
    width, height = fig.get_size_inches()
    assert width < 20 and height > 5
    np.testing.assert_array_equal(shown[29].images[0].get_array(), m.weights[29, :, 1])
    assert _labels(shown[6].get_yticklabels()) == ["head 0", "head 1"]  # a row's first panel
    assert shown[7].get_yticklabels() == []
    fig7 = draw_focus(_maps(L=7, H=2), 0)  # a second row of one panel: the rest hidden
    assert sum(ax.get_visible() for ax in fig7.axes) == 7 and len(fig7.axes) == 12
    plt.close("all")


def test_alignment_is_target_by_source_mean_of_heads():
    m = _maps(kind="cross", tokens=("4", "7"), queries=("four", "thousand", "seven"))
    fig = draw_alignment(m)
    assert len(fig.axes) == 2
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), m.weights[0].mean(0), rtol=1e-6)
    assert _labels(fig.axes[0].get_yticklabels()) == ["four", "thousand", "seven"]
    assert _labels(fig.axes[1].get_xticklabels()) == ["4", "7"]
    with pytest.raises(ValueError, match="cross-attention"):
        draw_alignment(_maps())
    plt.close("all")


def test_image_attention_paints_each_layer_and_head_over_the_image():
    keys = ("[CLS]", *(f"({r},{c})" for r in range(2) for c in range(2)))
    m = _maps(L=2, H=2, tokens=keys, kind="image", queries=("[CLS]",))
    fig = draw_image_attention(m, np.zeros((8, 8)))
    assert len(fig.axes) == 2 * (2 + 2)  # the image, the mean, each head; per layer
    overlay = fig.axes[3].images[1].get_array()  # layer 0, head 1
    np.testing.assert_allclose(overlay, m.weights[0, 1, 0, 1:].reshape(2, 2), rtol=1e-6)
    with pytest.raises(ValueError, match="image maps"):
        draw_image_attention(_maps(), np.zeros((8, 8)))
    plt.close("all")


def test_importance_figure_has_a_panel_per_attention_row():
    tokens = ["a", "b", "c"]
    fig = draw_importance(
        tokens,
        {"leave-one-out": np.array([0.1, 0.5, 0.2])},
        {"layer 1": np.array([0.2, 0.3, 0.5]), "rollout": np.array([0.3, 0.3, 0.4])},
        {"layer 1": {"leave-one-out": 0.5}, "rollout": {"leave-one-out": -0.5}},
    )
    assert len(fig.axes) == 2
    assert "ρ(leave-one-out) = +0.50" in fig.axes[0].get_title()
    assert _labels(fig.axes[1].get_xticklabels()) == tokens
    with pytest.raises(ValueError, match="expected \\(3,\\)"):
        draw_importance(tokens, {"x": np.ones(2)}, {"y": np.ones(3)}, {})
    plt.close("all")
