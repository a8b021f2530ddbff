"""Text models as the maps and the faithfulness check see them, and their attention on a text.

Notation: ``T`` tokens, ``C`` width, ``V`` vocabulary.

A :class:`TextModel` wraps a dikkat BERT or GPT, the real all-MiniLM-L6-v2
(:func:`dikkat.pretrained.minilm`) or a Hugging Face model (:func:`dikkat.maps.hf_model`) behind
one forward: ids (1, T) → hidden states (1, T, C) for an encoder, logits (1, T, V) for a causal
model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dikkat.maps.collect import Selection, collect, layer_family, token_labels
from dikkat.models.bert import BERT
from dikkat.models.gpt import GPT
from dikkat.pretrained.minilm import SentenceEncoder
from dikkat.pretrained.session import Pretrained
from dikkat.viz.maps import AttentionMaps

__all__ = ["TextModel", "encode_text", "mask_id_of", "text_maps", "text_model"]


@dataclass(frozen=True)
class TextModel:
    """A text model, its tokenizer, and the one forward the maps run."""

    module: nn.Module  # what dikkat.capture hooks
    tokenizer: Any  # a dikkat tokenizer (encode → ids) or a tokenizers.Tokenizer (→ Encoding)
    forward: Callable[[Tensor], Tensor]  # ids (N, T) → hidden (N, T, C), or logits (N, T, V)
    causal: bool  # a next-token model (forward gives logits), not an encoder
    embedding: nn.Module  # the token embedding, whose output gradient × input reads
    mask_id: int | None = None  # the id that hides a token ([MASK]); None: remove it instead
    name: str = ""  # what the titles call it

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device


def mask_id_of(tokenizer: Any, vocab_size: int) -> int | None:
    inner = getattr(tokenizer, "inner", tokenizer)
    if hasattr(inner, "token_to_id") and inner.token_to_id("[MASK]") is not None:
        return int(inner.token_to_id("[MASK]"))
    # a BERT of `dikkat train --task mlm` has one id past its tokenizer's: [MASK]
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size + 1 == vocab_size else None


def text_model(
    model: BERT | GPT | SentenceEncoder | Pretrained, tokenizer: Any = None
) -> TextModel:
    """A dikkat BERT (its encoder's hidden states), GPT (its logits), a sentence encoder
    (MiniLM: its BERT and tokenizer) or a pretrained decoder (:func:`dikkat.pretrained.load`:
    its logits) as a :class:`TextModel`."""
    if isinstance(model, Pretrained):
        lm = model.model
        return TextModel(lm, model.tokenizer, lm, causal=True, embedding=lm.tok_emb,
                         name=model.name)  # fmt: skip
    name = "BERT"
    if isinstance(model, SentenceEncoder):
        tokenizer = model.tokenizer if tokenizer is None else tokenizer
        model, name = model.model, "sentence encoder"
    if tokenizer is None:
        raise ValueError("text_model needs the model's tokenizer")
    if isinstance(model, BERT):
        return TextModel(
            model,
            tokenizer,
            lambda ids: model.encode(ids),
            causal=False,
            embedding=model.tok_emb,
            mask_id=mask_id_of(tokenizer, model.config.vocab_size),
            name=name,
        )
    if isinstance(model, GPT):
        return TextModel(model, tokenizer, model, causal=True, embedding=model.tok_emb, name="GPT")
    raise TypeError(
        f"text_model takes a BERT, a GPT or a SentenceEncoder, got {type(model).__name__}"
    )


def encode_text(tm: TextModel, text: str) -> tuple[list[int], tuple[str, ...]]:
    """The ids of ``text`` (with the special tokens the tokenizer adds: ``[CLS]`` … ``[SEP]``)
    and a label per id."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    inner = getattr(tm.tokenizer, "inner", tm.tokenizer)
    encoded = inner.encode(text) if hasattr(inner, "encode") else tm.tokenizer.encode(text)
    ids = list(getattr(encoded, "ids", encoded))  # a tokenizers.Encoding, or a list of ids
    if not ids:
        raise ValueError(f"text {text!r} encodes to no tokens")
    return ids, token_labels(tm.tokenizer, ids)


def text_maps(
    tm: TextModel,
    text: str,
    *,
    layers: Selection = None,
    heads: Selection = None,
    rows: Selection = None,
    title: str | None = None,
) -> AttentionMaps:
    """The self-attention of ``tm`` on ``text``: every token a query and a key, the special
    tokens included; ``rows`` keeps just those query positions (negative from the end), so a
    long text costs rows × T weights per head, not T²."""
    ids, labels = encode_text(tm, text)
    x = torch.tensor([ids], device=tm.device)
    was = tm.module.training
    tm.module.eval()  # the weights of the model as it is used: no dropout
    try:
        return collect(
            tm.module,
            lambda: tm.forward(x),
            family=layer_family(tm.module),
            queries=labels,
            keys=labels,
            layers=layers,
            heads=heads,
            rows=rows,
            title=f"{tm.name}: {text!r}" if title is None else title,
        )
    finally:
        tm.module.train(was)
