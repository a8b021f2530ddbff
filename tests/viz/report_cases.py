"""The attention maps the HTML report's tests draw: small, with hostile token labels."""

from __future__ import annotations

import numpy as np

from dikkat.viz.maps import AttentionMaps

# labels that break a page that pastes text into HTML or into a <script> (each under 30 chars,
# the length the head view shows in full)
HOSTILE = (
    "</script><b>bold</b>",
    '<img src=x onerror="pwned=1">',
    "a & b &amp; \"q\" 'c'",
    "<!-- x",
)


def report_maps(kind: str = "cross", layers: int = 2, heads: int = 3) -> AttentionMaps:
    """Softmax rows of seeded random scores, (layers, heads, 5, 6); layer 1 differs from 0."""
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(layers, heads, 5, 6)) * 2.0
    w = np.exp(scores)
    w /= w.sum(-1, keepdims=True)
    return AttentionMaps(
        queries=(*HOSTILE, "x"),
        keys=("le", "chat", HOSTILE[0], "noir", "€ü", "."),
        layers=tuple(f"layer {i}" for i in range(layers)),
        heads=tuple(range(0, 2 * heads, 2)),  # heads 0, 2, 4: numbers, not positions
        weights=w.astype(np.float32),
        rows=(3, 4, 5, 6, 7),
        kind=kind,
        title="<i>hostile</i> & co",
    )
