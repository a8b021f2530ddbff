"""A translator's cross-attention as an alignment of its output with its source.

Notation: ``S`` source tokens, ``T`` target tokens.

The decoder reads ``<bos>`` and the tokens it produced so far; its query at input position i
produces target token i. So a row of the alignment is labelled by the token it produced, and
its weights say which source tokens that step's cross-attention read (Bahdanau et al. 2015
drew their alignments the same way, arXiv:1409.0473).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dikkat.maps.collect import Selection, collect, find_token, layer_family, token_labels
from dikkat.maps.faithfulness import Faithfulness, gradient_x_input
from dikkat.models.seq2seq import Seq2Seq
from dikkat.viz.maps import AttentionMaps

__all__ = ["Translation", "translate", "translation_faithfulness", "translation_maps"]


@dataclass(frozen=True)
class Translation:
    """A source and what the decoder produced from it."""

    source: tuple[int, ...]  # (S,) source ids
    produced: tuple[int, ...]  # (T,) target ids after <bos>, the <eos> included when produced
    bos_id: int

    @property
    def decoder_input(self) -> tuple[int, ...]:
        """What the decoder reads to produce ``produced``: ``<bos>`` and all but the last."""
        return (self.bos_id, *self.produced[:-1])


def translate(
    model: Seq2Seq,
    source: Sequence[int],
    *,
    bos_id: int,
    eos_id: int | None = None,
    max_new_tokens: int = 16,
) -> Translation:
    """Greedy translation of one source."""
    source = tuple(int(i) for i in source)
    if not source:
        raise ValueError("source is empty")
    produced = model.generate([list(source)], max_new_tokens, bos_id=bos_id, eos_id=eos_id)[0]
    if not produced:
        raise ValueError(f"the model produced no target token (max_new_tokens={max_new_tokens})")
    return Translation(source, tuple(produced), bos_id)


def _run(model: Seq2Seq, t: Translation, src: Tensor | None = None) -> Tensor:
    device = model.tgt_emb.weight.device
    src = torch.tensor([t.source], device=device) if src is None else src
    tgt = torch.tensor([t.decoder_input], device=device)
    return model.decode(tgt, model.encode(src), None)  # (1, T, V)


def translation_maps(
    model: Seq2Seq,
    tokenizer: Any,
    t: Translation,
    *,
    layers: Selection = None,
    heads: Selection = None,
    rows: Selection = None,
    title: str | None = None,
) -> AttentionMaps:
    """The decoder's cross-attention while it produces ``t.produced`` from ``t.source``: kind
    ``"cross"``, a row per produced target token (labelled by it), a key per source token;
    ``layers`` index the decoder's layers."""
    was = model.training
    model.eval()
    try:
        return collect(
            model,
            lambda: _run(model, t),
            family=layer_family(model, ".cross_attn"),
            queries=token_labels(tokenizer, t.produced),
            keys=token_labels(tokenizer, t.source),
            layers=layers,
            heads=heads,
            rows=rows,
            kind="cross",
            title=f"translator: {' '.join(token_labels(tokenizer, t.source))}"
            if title is None
            else title,
        )
    finally:
        model.train(was)


def translation_faithfulness(
    model: Seq2Seq, tokenizer: Any, t: Translation, focus: int | str
) -> Faithfulness:
    """The cross-attention of the produced token ``focus`` (a row or a token) on the source,
    each layer's mean over heads, against each source token's importance to the
    log-probability of that token: leave-one-out (the source token removed) and
    gradient × input on the source embeddings."""
    produced = token_labels(tokenizer, t.produced)
    f = find_token(produced, focus)
    full = translation_maps(model, tokenizer, t)
    target = t.produced[f]
    device = model.tgt_emb.weight.device
    src = torch.tensor([t.source], device=device)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            base = _run(model, t)[0, f].double().log_softmax(-1)[target]
            loo = np.full(len(t.source), np.nan)
            for j in range(len(t.source)):
                if len(t.source) > 1:
                    without = torch.cat([src[:, :j], src[:, j + 1 :]], dim=1)
                    lp = _run(model, t, without)[0, f].double().log_softmax(-1)[target]
                    loo[j] = abs(float(base - lp))

        def scalar() -> Tensor:  # the source embedding is called first (encode, then decode)
            return _run(model, t)[0, f].log_softmax(-1)[target]

        grad = gradient_x_input(model.src_emb, scalar)
    finally:
        model.train(was)
    attention = {
        f"{layer} (mean of heads)": full.weights[i, :, f].mean(axis=0).astype(np.float64)
        for i, layer in enumerate(full.layers)
    }
    return Faithfulness(
        focus=produced[f],
        position=f,
        output=f"|Δ log p({produced[f]!r})| when the source token is removed; gradient × input",
        tokens=token_labels(tokenizer, t.source),
        positions=tuple(range(len(t.source))),
        importance={"leave-one-out": loo, "gradient × input": grad},
        attention=attention,
    )
