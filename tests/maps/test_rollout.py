"""Attention rollout (arXiv:2005.00928) against the formula written out in float64."""

from __future__ import annotations

import numpy as np
import pytest

from dikkat import maps
from dikkat.viz.maps import MEAN_OF_HEADS, AttentionMaps


def test_two_layers_by_hand():
    # layer 0: two heads over 2 tokens; layer 1: one head put twice
    a0 = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]])  # (H, T, T)
    a1 = np.array([[[0.2, 0.8], [0.0, 1.0]]] * 2)
    got = maps.rollout(np.stack([a0, a1]))
    # written out: mean over heads, + I, rows / 2, then Â1 · Â0
    m0 = (np.array([[0.5, 0.5], [0.5, 0.5]]) + np.eye(2)) / 2  # [[.75, .25], [.25, .75]]
    m1 = (np.array([[0.2, 0.8], [0.0, 1.0]]) + np.eye(2)) / 2  # [[.6, .4], [0, 1]]
    np.testing.assert_allclose(got[0], [[0.75, 0.25], [0.25, 0.75]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(got[1], m1 @ m0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(got[1], [[0.55, 0.45], [0.25, 0.75]], rtol=0, atol=1e-15)
    assert got.dtype == np.float64


def test_rows_stay_distributions_and_a_blind_row_is_the_identity():
    rng = np.random.default_rng(0)
    w = rng.random((3, 2, 5, 5))
    w /= w.sum(-1, keepdims=True)
    w[:, :, 2] = 0  # a query that saw no key
    r = maps.rollout(w)
    np.testing.assert_allclose(r.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(r[0, 2], np.eye(5)[2], atol=1e-15)


def _full(L: int = 2, T: int = 4) -> AttentionMaps:
    w = np.full((L, 2, T, T), 1 / T, dtype=np.float32)
    return AttentionMaps(
        queries=tuple("abcd"[:T]), keys=tuple("abcd"[:T]),
        layers=tuple(f"layer {i}" for i in range(L)), heads=(0, 1), weights=w,
    )  # fmt: skip


def test_rollout_maps_keep_the_chosen_layers_and_rows():
    r = maps.rollout_maps(_full(), layers=[-1], rows=[0, 3])
    assert r.weights.shape == (1, 1, 2, 4) and r.heads == (MEAN_OF_HEADS,)
    assert r.head_labels == ("mean of heads",) and r.layers == ("rollout to layer 1",)
    assert r.queries == ("a", "d") and r.rows == (0, 3)
    expected = maps.rollout(_full().weights)[1][[0, 3]]
    np.testing.assert_allclose(r.weights[0, 0], expected, rtol=0, atol=1e-7)


def test_rollout_needs_every_row_and_layer():
    full = _full()
    part = AttentionMaps(
        queries=("d",), keys=full.keys, layers=full.layers, heads=(0, 1),
        weights=full.weights[:, :, 3:], rows=(3,),
    )  # fmt: skip
    with pytest.raises(ValueError, match="every query row"):
        maps.rollout_maps(part)
    later = AttentionMaps(
        queries=full.queries, keys=full.keys, layers=("layer 1",), heads=(0, 1),
        weights=full.weights[1:],
    )  # fmt: skip
    with pytest.raises(ValueError, match="every layer from the first"):
        maps.rollout_maps(later)
