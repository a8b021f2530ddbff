"""dikkat.hf's mask function: transformers' own mask builders give, through it, the masks they
give transformers' eager attention — as dikkat's structured masks where dikkat has the shape.

Notation: ``B`` batch, ``T`` query length, ``S`` key length.

The oracle is transformers itself: each case calls one of ``masking_utils``' builders
(``create_causal_mask`` and its siblings) twice, once for ``eager`` (a dense 0 / −inf mask) and
once for the name ``dikkat.hf.register`` gave, and compares the cells.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import dikkat.hf
from dikkat import masks

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

NAME = dikkat.hf.register("dikkat-masks")
B, T, C = 3, 10, 16


def config(**extra: object) -> object:
    cfg = transformers.MistralConfig(
        vocab_size=11, hidden_size=C, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, **extra,
    )  # fmt: skip
    return cfg


def build(builder, cfg, implementation: str, **kwargs: object):
    cfg._attn_implementation = implementation
    return builder(config=cfg, inputs_embeds=torch.zeros(B, kwargs.pop("T", T), C), **kwargs)


def eager_cells(mask: Tensor | None, shape: tuple[int, int, int]) -> Tensor:
    """transformers' eager mask (0 = attend, finfo.min = hidden; None = every key) as bools."""
    return torch.ones(shape[0], 1, *shape[1:], dtype=torch.bool) if mask is None else mask == 0


def dikkat_cells(made: dikkat.hf.HFMask) -> Tensor:
    shape = (made.batch, 1, made.q_length, made.kv_length)
    if made.mask is None:
        return torch.ones(shape, dtype=torch.bool)
    return made.mask.materialize(*shape, q_offset=made.q_offset).expand(shape)


def parts(mask: masks.Mask | None) -> list[type]:
    """The mask types an And/Or tree is built from, leaves first."""
    if isinstance(mask, (masks.And, masks.Or)):
        return parts(mask.left) + parts(mask.right)
    return [] if mask is None else [type(mask)]


def left_padded(lengths: list[int], n: int) -> Tensor:
    return torch.arange(n)[None, :] >= (n - torch.tensor(lengths))[:, None]


def right_padded(lengths: list[int], n: int) -> Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def compare(builder, cfg, **kwargs: object) -> dikkat.hf.HFMask:
    eager = build(builder, cfg, "eager", **dict(kwargs))
    made = build(builder, cfg, NAME, **kwargs)
    assert isinstance(made, dikkat.hf.HFMask)
    want = eager_cells(eager, (made.batch, made.q_length, made.kv_length))
    got = dikkat_cells(made)
    assert got.shape == want.shape
    assert torch.equal(got, want), (got.int(), want.int())
    return made


PADDINGS = {
    "none": None,
    "left": left_padded([10, 7, 4], T),
    "right": right_padded([10, 6, 3], T),
}


@pytest.mark.parametrize("pad", list(PADDINGS))
def test_causal_becomes_dikkat_causal_and_padding(pad):
    made = compare(mu.create_causal_mask, config(), attention_mask=PADDINGS[pad], cache=None)
    kinds = parts(made.mask)
    assert kinds[0] is masks.Causal
    assert kinds[1:] == ([] if pad == "none" else [masks.Padding])
    if pad == "right":  # per-row lengths: the key range stops at the longest row
        assert made.mask.kv_range(0, 4, T) == (0, 4)


@pytest.mark.parametrize("pad", list(PADDINGS))
def test_sliding_window_becomes_dikkat_sliding_window(pad):
    cfg = config(sliding_window=3)
    made = compare(
        mu.create_sliding_window_causal_mask, cfg, attention_mask=PADDINGS[pad], cache=None
    )
    assert parts(made.mask)[0] is masks.SlidingWindow
    assert made.mask.kv_range(8, 10, T)[0] == 6  # the tiled backend never looks at keys 0 … 5


@pytest.mark.parametrize("pad", ["none", "left"])
def test_chunked_becomes_documents_of_chunks(pad):
    cfg = config()
    cfg.attention_chunk_size = 4
    made = compare(mu.create_chunked_causal_mask, cfg, attention_mask=PADDINGS[pad], cache=None)
    assert parts(made.mask)[0] is masks.Document


@pytest.mark.parametrize("pad", list(PADDINGS))
def test_bidirectional_becomes_padding_alone(pad):
    made = compare(mu.create_bidirectional_mask, config(), attention_mask=PADDINGS[pad])
    assert parts(made.mask) == ([] if pad == "none" else [masks.Padding])


@pytest.mark.parametrize("pad", list(PADDINGS))
def test_a_bidirectional_window_becomes_a_window_that_looks_ahead(pad):
    made = compare(
        mu.create_bidirectional_mask, config(), attention_mask=PADDINGS[pad],
        and_mask_function=mu.sliding_window_bidirectional_overlay(2),
    )  # fmt: skip
    assert masks.SlidingWindow in parts(made.mask)
    assert made.mask.kv_range(4, 6, T) == (2, 8)  # queries 4, 5 see keys 2 … 7, no more


@pytest.mark.parametrize("window", [None, 3])
def test_packed_sequences_become_documents(window):
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * B)
    builder = mu.create_causal_mask if window is None else mu.create_sliding_window_causal_mask
    made = compare(
        builder, config(sliding_window=window), attention_mask=None, cache=None,
        position_ids=positions,
    )  # fmt: skip
    assert masks.Document in parts(made.mask)
    assert made.mask.kv_range(7, 10, T)[0] == 7  # the third sequence starts at 7


@pytest.mark.parametrize("past", [2, 9])
def test_cache_offsets_sliding_and_full(past):
    """With a cache the queries sit after ``past`` keys; a sliding-window layer keeps only the
    last ``window - 1`` of them, so transformers numbers its keys from an offset."""
    cfg = config(sliding_window=4)
    cache = transformers.DynamicCache(config=cfg)
    kv = torch.randn(B, 1, past, 8)
    for layer in range(cfg.num_hidden_layers):
        cache.update(kv, kv, layer)
    pad = left_padded([past + 3, past + 2, past], past + 3)
    made = compare(mu.create_sliding_window_causal_mask, cfg, attention_mask=pad, cache=cache, T=3)
    assert made.q_offset == min(past, 3)  # after the past keys the layer still holds


def test_an_unknown_predicate_is_kept_dense_and_exact():
    def every_other(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx) % 2 == 0

    made = compare(
        mu.create_causal_mask, config(), attention_mask=PADDINGS["left"], cache=None,
        and_mask_function=every_other,
    )  # fmt: skip
    kinds = parts(made.mask)
    assert masks.Causal in kinds and masks.DenseMask in kinds  # causal keeps its key range
