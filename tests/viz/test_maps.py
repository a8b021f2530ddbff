"""AttentionMaps: what the pictures draw, checked where it is made."""

from __future__ import annotations

import numpy as np
import pytest

from dikkat.viz.maps import AttentionMaps


def _maps(**change: object) -> AttentionMaps:
    w = np.full((2, 3, 4, 5), 0.2, dtype=np.float32)
    fields = dict(
        queries=tuple("abcd"), keys=tuple("abcde"), layers=("layer 0", "layer 1"),
        heads=(0, 1, 2), weights=w,
    )  # fmt: skip
    return AttentionMaps(**{**fields, **change})


def test_positions_default_to_the_rows() -> None:
    assert _maps().query_positions == (0, 1, 2, 3)
    assert _maps(rows=(5, 6, 7, 9)).query_positions == (5, 6, 7, 9)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"keys": ("a",)}, "keys has 1 labels but weights"),
        ({"heads": (0,)}, "heads has 1 labels"),
        ({"weights": np.zeros((2, 3, 4))}, "4-D numpy array"),
        ({"weights": np.full((2, 3, 4, 5), np.nan)}, "finite and non-negative"),
        ({"rows": (1, 2)}, "rows has 2 positions"),
        ({"kind": "both"}, "kind must be one of"),
    ],
)
def test_inconsistent_maps_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _maps(**change)


def test_pick_keeps_the_layers_and_heads_asked_for_and_spread_takes_the_ends() -> None:
    from dikkat.viz.maps import spread

    w = np.random.default_rng(0).random((5, 3, 2, 2)).astype(np.float32)
    m = AttentionMaps(queries=("a", "b"), keys=("a", "b"), weights=w / w.sum(-1, keepdims=True),
                      layers=tuple(f"layer {i}" for i in range(5)), heads=(0, 1, 2))  # fmt: skip
    p = m.pick([0, -1], [2])
    assert p.layers == ("layer 0", "layer 4") and p.heads == (2,)
    np.testing.assert_array_equal(p.weights, m.weights[[0, 4]][:, [2]])
    assert m.pick().weights.shape == m.weights.shape
    with pytest.raises(IndexError):
        m.pick([5])
    assert spread(30, 6) == [0, 6, 12, 17, 23, 29]
    assert spread(4, 6) == [0, 1, 2, 3] and spread(2, 2) == [0, 1]
