"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers",
arXiv:2005.00928): how much each input token reaches each position through the layers.

Notation: ``L`` layers, ``H`` heads, ``T`` tokens.

A layer's output is its input plus what attention mixed in (the residual connection), so the
paper models the flow through layer l as the head-averaged weights plus the identity, rows
renormalised: Â_l = (mean_h A_l + I) / 2 (each row of A sums to 1, or is 0 for a query that
saw no key — then its renormalised row is the identity's). The rollout to layer l multiplies
them: Ã_l = Â_l · Ã_(l−1), Ã_0 = Â_0.
"""

from __future__ import annotations

import numpy as np

from dikkat.maps.collect import Selection, pick
from dikkat.viz.maps import MEAN_OF_HEADS, AttentionMaps

__all__ = ["rollout", "rollout_maps"]


def rollout(weights: np.ndarray) -> np.ndarray:
    """(L, H, T, T) weights of consecutive layers from the first → (L, T, T): entry [l, i, j]
    is how much input token j flows into position i after layer l. Computed in float64."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 4 or w.shape[2] != w.shape[3]:
        raise ValueError(f"rollout needs square self-attention weights (L, H, T, T), got {w.shape}")
    L, _, T, _ = w.shape
    eye = np.eye(T)
    a = w.mean(axis=1) + eye  # (L, T, T)
    a /= a.sum(axis=-1, keepdims=True)
    out = np.empty_like(a)
    out[0] = a[0]
    for layer in range(1, L):
        out[layer] = a[layer] @ out[layer - 1]
    return out


def rollout_maps(
    full: AttentionMaps, *, layers: Selection = None, rows: Selection = None
) -> AttentionMaps:
    """The rollout of ``full`` — every layer from the first, every head and every query row of
    a self-attention or image map — as maps of one head (:data:`MEAN_OF_HEADS`) per layer,
    keeping the rollout to ``layers`` and the query ``rows`` chosen (indices, negative from the
    end)."""
    L, _, Tq, Tk = full.weights.shape
    if Tq != Tk or full.query_positions != tuple(range(Tk)):
        raise ValueError(
            f"rollout needs every query row of every layer and head: the maps hold rows "
            f"{full.query_positions[:8]}… of {Tk} keys (capture with rows=None)"
        )
    expected = tuple(f"layer {i}" for i in range(L))
    if full.layers != expected:
        raise ValueError(f"rollout needs every layer from the first, got {full.layers}")
    if full.kind == "cross":
        raise ValueError("rollout follows self-attention through the layers, not cross-attention")
    kept_layers, kept_rows = pick("layers", layers, L), pick("rows", rows, Tq)
    flow = rollout(full.weights)[np.ix_(kept_layers, kept_rows)]  # (l, r, T)
    return AttentionMaps(
        queries=tuple(full.queries[i] for i in kept_rows),
        keys=full.keys,
        layers=tuple(f"rollout to layer {i}" for i in kept_layers),
        heads=(MEAN_OF_HEADS,),
        weights=flow[:, None].astype(np.float32),
        rows=tuple(kept_rows),
        kind=full.kind,
        title=full.title,
    )
