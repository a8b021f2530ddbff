"""The engine's batched decode forward (:mod:`dikkat.serving.forward`): each row's logits are an
fp64 forward's over that row's tokens alone, whatever the other rows' lengths, and the mask it
hands the model is the rows' padding alone, or none when the rows are equally long."""

from __future__ import annotations

import pytest
import torch

from dikkat.core.masks import DenseMask
from dikkat.generation.sampler import largest, largest_finite
from dikkat.models import GPT, Decoder, DecoderConfig, GPTConfig
from dikkat.models.decoder import gemma3_layer_kinds
from dikkat.serving.forward import decode, prefill
from dikkat.serving.paged import PagedKVPool
from helpers import scramble

V = 37
P = 4  # slots per block

GEMMA_LIKE = DecoderConfig(
    family="gemma3", vocab_size=V, max_len=32, d_model=32, n_layers=6, n_heads=4, n_kv_heads=1,
    head_dim=16, d_ff=48, activation="gelu_tanh", sliding_window=3,
    layer_kinds=gemma3_layer_kinds(6), qk_norm=True, sandwich_norm=True, embed_scale=True,
)  # fmt: skip


def make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(GPTConfig(vocab_size=V, max_len=32, d_model=32, n_layers=2, n_heads=4))
    else:
        model = Decoder(GEMMA_LIKE)
    return scramble(model, 0).eval()


def rows_of(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(len(lengths))
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def cached(model: torch.nn.Module, rows: list[list[int]]) -> tuple[PagedKVPool, list[list[int]]]:
    """A pool holding every row's tokens but its last, each row in blocks of its own."""
    layout = model.cache_layout()
    pool = PagedKVPool(layout.n_layers, 16, P, layout.kv_heads, layout.head_dim, dtype=layout.dtype)
    tables, free = [], iter(range(16))
    for row in rows:
        table = [next(free) for _ in range(-(-len(row) // P))]
        prefill(model, pool, row[:-1], table, 0)
        tables.append(table)
    return pool, tables


def decode_last(model: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    pool, tables = cached(model, rows)
    return decode(model, pool, [r[-1] for r in rows], [len(r) - 1 for r in rows], tables)


@pytest.mark.parametrize("kind", ["gpt", "gemma"])
@pytest.mark.parametrize("lengths", [(9, 3, 9), (6, 6)])
def test_each_row_decodes_as_an_fp64_forward_over_it_alone(kind, lengths):
    model = make(kind).double()  # the gemma-like model's window of 3 is shorter than the rows
    rows = rows_of(lengths)
    logits = decode_last(model, rows)  # (B, V)
    with torch.no_grad():
        for b, row in enumerate(rows):
            want = model(torch.tensor([row]))[0, -1]
            torch.testing.assert_close(logits[b], want, rtol=1e-10, atol=1e-10)
            assert want.abs().max() > 1  # logits that mean something


def test_the_mask_is_the_padding_alone_and_none_for_rows_of_equal_length():
    model = make("gpt")
    masks = []

    def spy(module, args, kwargs):
        masks.append(args[1] if len(args) > 1 else kwargs.get("mask"))

    handle = model.register_forward_pre_hook(spy, with_kwargs=True)
    rows = rows_of((5, 5))
    decode_last(model, rows)
    assert masks[-1] is None  # no pads: SDPA's unmasked kernel, as generate decodes one row
    decode_last(model, rows_of((5, 2, 4)))
    handle.remove()
    mask = masks[-1]
    assert isinstance(mask, DenseMask) and mask.q_offset == 4  # the new tokens' column, S − 1
    want = torch.tensor([[True] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    assert torch.equal(mask.tensor.view(3, 5), want)  # right-aligned rows, pads on the left


def test_the_engine_picks_greedy_tokens_as_a_sampler_does():
    """The batch's greedy picks are :func:`largest`'s (the first of equal values, a NaN as the
    largest, the native kernel where it is loaded), read back with each row's finiteness."""
    logits = torch.randn(5, V)
    logits[1, 3] = logits[1, 7] = 50.0  # a tie: the first
    logits[2, 4] = float("nan")
    logits[3, 9] = float("inf")
    logits[4] = float("-inf")
    picks, finite = largest_finite(logits)
    assert picks == largest(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert picks[1] == 3 and picks[2] == 4
    assert finite == [True, True, False, False, False]
