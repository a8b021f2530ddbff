"""Masks against a plain double loop over (b, h, i, j), and the PyTorch mask conversion.

Convention: True = may attend. ``i`` is the row of a query; its absolute position is
``q_offset + i``; ``j`` is the position of a key.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from dikkat.core import masks
from helpers import dense_tensors

# allowed(b, h, position of the query, j) -> bool, written the slow obvious way
Rule = Callable[[int, int, int, int], bool]


def brute_force(rule: Rule, B: int, H: int, T: int, S: int, q_offset: int) -> Tensor:
    out = torch.zeros(B, H, T, S, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(T), range(S)):
        out[b, h, i, j] = rule(b, h, q_offset + i, j)
    return out


def full(mask: masks.Mask, B: int, H: int, T: int, S: int, q_offset: int) -> Tensor:
    m = mask.materialize(B, H, T, S, q_offset)
    assert m.dtype == torch.bool and m.dim() == 4
    return m.expand(B, H, T, S)


@st.composite
def grids(draw, max_len: int = 7) -> tuple[int, int, int, int, int]:
    """(B, H, T, S, q_offset) with the queries inside the keys when q_offset > 0, and the first
    queries before key 0 when it is negative."""
    B, H, T = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, max_len))
    q_offset = draw(st.integers(-4, 4))
    S = draw(st.integers(1, max_len)) if q_offset <= 0 else draw(st.integers(T + q_offset, 12))
    return B, H, T, S, q_offset


# --- each built-in mask against its rule ----------------------------------------------------------


@st.composite
def masks_with_rules(draw, B: int, H: int, T: int, S: int, q_offset: int):
    """A built-in mask that fits the grid, with the rule it must implement."""
    kinds = ["causal", "window", "lengths", "valid", "dense", "bare"]
    if q_offset >= 0:  # the masks that place queries in a sequence refuse positions before 0
        kinds += ["document", "prefix"]
    kind = draw(st.sampled_from(kinds))
    if kind == "causal":
        return masks.causal(), lambda b, h, p, j: p >= j
    if kind == "window":
        w, r = draw(st.integers(1, S + 2)), draw(st.integers(0, S + 1))
        return masks.sliding_window(w, ahead=r), lambda b, h, p, j: p - w < j <= p + r
    if kind == "lengths":
        n = draw(st.sampled_from([1, B]))  # one length for the batch, or one per sequence
        lengths = draw(st.lists(st.integers(0, S + 1), min_size=n, max_size=n))
        per_b = lengths * B if n == 1 else lengths
        return masks.padding(torch.tensor(lengths)), lambda b, h, p, j: j < per_b[b]
    if kind == "valid":
        valid = draw(
            st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=B, max_size=B)
        )
        return masks.padding(valid=torch.tensor(valid)), lambda b, h, p, j: valid[b][j]
    if kind == "document":
        N = max(q_offset + T, S) + draw(st.integers(0, 2))
        ids = draw(
            st.lists(st.lists(st.integers(0, 2), min_size=N, max_size=N), min_size=B, max_size=B)
        )
        return masks.document(
            torch.tensor(ids)
        ), lambda b, h, p, j: ids[b][p] == ids[b][j] and p >= j
    if kind == "prefix":
        prefix = draw(st.lists(st.integers(0, S + 1), min_size=B, max_size=B))
        return masks.prefix_lm(torch.tensor(prefix)), lambda b, h, p, j: j < prefix[b] or p >= j
    # a dense tensor: its rows are the queries as passed, so row i is position q_offset + i
    t = draw(dense_tensors(B, H, T, S))
    t4 = t.view((1,) * (4 - t.dim()) + tuple(t.shape))

    def rule(b: int, h: int, p: int, j: int) -> bool:
        idx = [b, h, p - q_offset, j]
        return bool(t4[tuple(0 if n == 1 else x for x, n in zip(idx, t4.shape, strict=True))])

    return masks.as_mask(t, q_offset) if kind == "bare" else masks.dense(t, q_offset), rule


@given(data=st.data())
def test_builtin_masks_match_the_loop(data) -> None:
    B, H, T, S, q_offset = data.draw(grids(), label="grid")
    mask, rule = data.draw(masks_with_rules(B, H, T, S, q_offset), label="mask")
    assert torch.equal(full(mask, B, H, T, S, q_offset), brute_force(rule, B, H, T, S, q_offset))


@given(data=st.data())
def test_combinations_match_the_loop(data) -> None:
    B, H, T, S, q_offset = data.draw(grids(), label="grid")
    (m1, r1), (m2, r2) = (data.draw(masks_with_rules(B, H, T, S, q_offset)) for _ in range(2))
    cases = {
        "and": (m1 & m2, lambda *x: r1(*x) and r2(*x)),
        "or": (m1 | m2, lambda *x: r1(*x) or r2(*x)),
        "not": (~m1, lambda *x: not r1(*x)),
        "nested": (~(m1 & ~m2) | m1, lambda *x: (not (r1(*x) and not r2(*x))) or r1(*x)),
    }
    for name, (mask, rule) in cases.items():
        want = brute_force(rule, B, H, T, S, q_offset)
        assert torch.equal(full(mask, B, H, T, S, q_offset), want), name


def test_bool_tensor_on_either_side_of_an_operator() -> None:
    t = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    c = masks.causal().materialize(1, 1, 3, 3)[0, 0]
    for combined, want in [
        (t & masks.causal(), t & c),
        (masks.causal() & t, t & c),
        (t | masks.causal(), t | c),
        (masks.causal() | t, t | c),
    ]:
        assert isinstance(combined, masks.Mask)
        assert torch.equal(combined.materialize(1, 1, 3, 3)[0, 0], want)


def test_module_docstring_example() -> None:
    m = masks.causal() & masks.padding(torch.tensor([3, 2]))
    assert m.materialize(2, 1, 3, 3)[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0]]


def test_causal_at_an_offset_sees_the_cache() -> None:
    # Two new queries at positions 3 and 4 over five keys: the last rows of the 5×5 causal mask.
    assert masks.causal().materialize(1, 1, 2, 5, q_offset=3)[0, 0].int().tolist() == [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]


def test_sliding_window_of_one_is_the_diagonal() -> None:
    assert torch.equal(masks.sliding_window(1).materialize(1, 1, 4, 4)[0, 0], torch.eye(4).bool())


def test_document_accepts_one_row_of_ids_for_the_batch() -> None:
    m = masks.document(torch.tensor([0, 0, 1, 1]))
    got = m.materialize(2, 1, 4, 4)
    assert got.shape[0] in (1, 2)
    assert got.expand(2, 1, 4, 4)[1, 0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 1, 1],
    ]


# --- materialize keeps unused dims at 1 ----------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "shape"),
    [
        (masks.causal(), (1, 1, 5, 6)),
        (masks.sliding_window(2), (1, 1, 5, 6)),
        (~masks.causal(), (1, 1, 5, 6)),
        (masks.padding(torch.tensor([1, 2])), (2, 1, 1, 6)),
        (masks.padding(valid=torch.ones(2, 6, dtype=torch.bool)), (2, 1, 1, 6)),
        (masks.document(torch.zeros(2, 6, dtype=torch.long)), (2, 1, 5, 6)),
        (masks.prefix_lm(torch.tensor([1, 3])), (2, 1, 5, 6)),
        (masks.dense(torch.ones(6, dtype=torch.bool)), (1, 1, 1, 6)),
        (masks.dense(torch.ones(5, 6, dtype=torch.bool)), (1, 1, 5, 6)),
        (masks.dense(torch.ones(1, 3, 1, 6, dtype=torch.bool)), (1, 3, 1, 6)),
        (masks.causal() & masks.padding(torch.tensor([1, 2])), (2, 1, 5, 6)),
    ],
    ids=repr,
)
def test_materialize_keeps_unused_dims_at_one(mask: masks.Mask, shape) -> None:
    assert tuple(mask.materialize(2, 3, 5, 6).shape) == shape


@pytest.mark.parametrize("mask", [masks.prefix_lm(2), masks.padding(torch.tensor([4]))], ids=repr)
def test_one_value_for_the_whole_batch_broadcasts(mask: masks.Mask) -> None:
    # One prefix length / one padding length serves every sequence. (It materialises with B
    # rows, not 1: the predicate indexes the value with the clamped batch index.)
    got = mask.materialize(2, 3, 5, 6)
    assert got.shape[0] in (1, 2) and got.shape[1] == 1
    assert torch.equal(got.expand(2, 3, 5, 6)[0], got.expand(2, 3, 5, 6)[1])


def test_is_causal_only_for_the_plain_causal_mask() -> None:
    assert masks.causal().is_causal
    for m in [masks.sliding_window(3), ~masks.causal(), masks.causal() & masks.causal()]:
        assert not m.is_causal


# --- from_torch_mask ------------------------------------------------------------------------------


def _bools(*shape: int, seed: int = 0) -> Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.5


def test_torch_bool_mask_true_means_blocked() -> None:
    blocked = _bools(4, 5)
    got = masks.from_torch_mask(blocked)
    assert got.dtype == torch.bool and got.shape == (1, 1, 4, 5)
    assert torch.equal(got[0, 0], ~blocked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_torch_float_mask_of_zeros_and_minus_inf(dtype) -> None:
    blocked = _bools(4, 5)
    additive = torch.zeros(4, 5, dtype=dtype).masked_fill(blocked, float("-inf"))
    assert torch.equal(masks.from_torch_mask(additive)[0, 0], ~blocked)


@pytest.mark.parametrize("value", [0.5, -1e9, float("inf"), float("nan")])
def test_torch_float_mask_with_other_values_is_refused(value: float) -> None:
    additive = torch.zeros(4, 5)
    additive[1, 2] = value
    with pytest.raises(ValueError, match="attn_mask holds additive values other than 0 and -inf"):
        masks.from_torch_mask(additive)
    with pytest.raises(ValueError, match="key_padding_mask holds additive values"):
        masks.from_torch_mask(key_padding_mask=additive)


def test_torch_integer_mask_is_refused() -> None:
    with pytest.raises(TypeError, match="attn_mask must be bool or float"):
        masks.from_torch_mask(torch.zeros(4, 5, dtype=torch.int64))


def test_torch_3d_mask_unfolds_batch_major_with_n_heads() -> None:
    B, n_heads, T, S = 2, 3, 4, 5
    blocked = _bools(B * n_heads, T, S)  # nn.MultiheadAttention: row b·n_heads + h
    got = masks.from_torch_mask(blocked, n_heads=n_heads)
    assert got.shape == (B, n_heads, T, S)
    for b, h in itertools.product(range(B), range(n_heads)):
        assert torch.equal(got[b, h], ~blocked[b * n_heads + h])


@pytest.mark.parametrize("n_heads", [None, 4])
def test_torch_3d_mask_needs_n_heads_dividing_its_first_dim(n_heads) -> None:
    with pytest.raises(ValueError, match=rf"3-D attn_mask of shape \(6, 4, 5\).*n_heads={n_heads}"):
        masks.from_torch_mask(_bools(6, 4, 5), n_heads=n_heads)


def test_torch_key_padding_mask_alone_and_combined() -> None:
    B, T, S = 2, 4, 5
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])  # True = padding
    keep = masks.from_torch_mask(key_padding_mask=pad)
    assert keep.shape == (B, 1, 1, S) and torch.equal(keep[:, 0, 0], ~pad)

    blocked = _bools(T, S)
    both = masks.from_torch_mask(blocked, pad).expand(B, 1, T, S)
    for b, i, j in itertools.product(range(B), range(T), range(S)):
        assert bool(both[b, 0, i, j]) == (not blocked[i, j] and not pad[b, j])

    additive_pad = torch.zeros(B, S).masked_fill(pad, float("-inf"))
    assert torch.equal(masks.from_torch_mask(key_padding_mask=additive_pad), keep)


def test_torch_masks_of_the_wrong_rank() -> None:
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(T, S\) or"):
        masks.from_torch_mask(_bools(5))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\)"):
        masks.from_torch_mask(key_padding_mask=_bools(2, 1, 5))


def test_no_torch_masks_is_no_mask() -> None:
    assert masks.from_torch_mask() is None
