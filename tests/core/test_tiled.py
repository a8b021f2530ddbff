"""The tiled backend with many tiles: exact in fp64, masked tiles skipped, lse, O(n) memory.

``test_backends.py`` runs every backend (this one included) under the 2× error rule on short
sequences, which fit in one tile; here small tiles force the online-softmax rescaling, tile
skipping, gathered windows and per-tile masks through every mask kind.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dikkat
from dikkat import masks
from dikkat.core import tiled
from dikkat.core.masks import as_mask
from helpers import Case, attention_cases, oracle


def run_tiled(
    case: Case,
    inputs,
    block: int,
    key_tile: int = 4096,
    cells: int = 1 << 22,
    windows: bool | None = None,
):
    q, k, v = (inputs[n].clone().requires_grad_() for n in "qkv")
    mask = None if case.mask is None else as_mask(case.mask, case.q_offset)
    if mask is not None and mask.is_full:
        mask = None
    out, lse = tiled.tiled_attention(
        q,
        k,
        v,
        mask,
        scale=1 / math.sqrt(case.D),
        bias=inputs["bias"],
        q_offset=case.q_offset,
        block=block,
        key_tile=key_tile,
        cells=cells,
        windows=windows,
    )
    grads = torch.autograd.grad(out, (q, k, v), inputs["dout"])
    return out.detach(), lse, grads


@given(
    case=attention_cases(max_len=40),
    block=st.sampled_from([1, 3, 8, 16]),
    key_tile=st.sampled_from([1, 5, 16, 4096]),
    cells=st.sampled_from([1, 50, 400, 1 << 22]),
    windows=st.sampled_from([None, False, True]),
    fused=st.booleans(),
)
def test_many_tiles_equal_the_fp64_reference(case, block, key_tile, cells, windows, fused):
    """Every way of cutting the work — rows or gathered windows, one or many key tiles, one
    or many blocks per tile, each tile in the fused kernel or in plain tensor ops — gives the
    reference's output, gradients and lse."""
    inputs = case.inputs()
    exact = oracle(case, inputs, torch.float64)
    saved, tiled.FUSED_TILES = tiled.FUSED_TILES, fused
    try:
        out, lse, (dq, dk, dv) = run_tiled(case, inputs, block, key_tile, cells, windows)
    finally:
        tiled.FUSED_TILES = saved
    for got, want in ((out, exact.out), (dq, exact.dq), (dk, exact.dk), (dv, exact.dv)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    # the log-sum-exp of each row, -inf where no key is allowed
    _, _, ref_lse = dikkat.attention(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        case.mask,
        bias=inputs["bias"],
        q_offset=case.q_offset,
        backend="reference",
        return_weights=True,
        return_lse=True,
    )
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-10, rtol=1e-10)


def computed_cells(mask, T: int, S: int, block: int, key_tile: int, windows=None) -> int:
    """Score cells the forward pass computes under the plan (skipped key tiles excluded), with
    tiles of block × key_tile cells."""
    total = 0
    for item in tiled._plan(mask, (1, 1, T, S), 0, block, block * key_tile, key_tile, windows):
        if isinstance(item, tiled._Windows):
            total += item.starts.numel() * block * item.width
            continue
        for k0 in tiled._key_tiles(item, key_tile):
            k1 = min(k0 + key_tile, item.k1)
            if tiled._tile_mask(mask, 1, 1, 1, item.r0, item.r1, k0, k1, "cpu") is not False:
                total += (item.r1 - item.r0) * (k1 - k0)
    return total


def test_hidden_work_is_skipped():
    n, b = 2048, 64
    assert computed_cells(None, n, n, b, 256) == n * n
    causal = computed_cells(masks.causal(), n, n, b, 256) / (n * n)
    assert 0.5 <= causal <= 0.6  # about half
    # a sliding window or packed documents: gathered windows, work linear in n
    for w in (64, 256):
        window = computed_cells(masks.sliding_window(w), n, n, b, 4096)
        assert window <= n * (w + b)  # each block: its w − 1 keys back plus its own
        cells = [computed_cells(masks.sliding_window(w), m, m, b, 4096) for m in (n, 2 * n, 4 * n)]
        assert cells[2] - cells[1] == 2 * (cells[1] - cells[0])  # a constant cost per block
    docs = masks.document(torch.arange(n) // (n // 8))  # 8 packed documents
    assert computed_cells(docs, n, n, b, 4096) <= n * (n // 8 + b)
    # forbidding windows falls back to rows, which still skip what kv_range excludes
    assert computed_cells(masks.sliding_window(64), n, n, b, 256, windows=False) < n * n / 4


def test_plans_choose_windows_only_for_sliding_ranges():
    def kinds(mask, n=1024):
        plan = tiled._plan(mask, (1, 8, n, n), 0, 128, 1 << 22, 4096, None)
        return {type(item).__name__ for item in plan}

    assert kinds(None) == kinds(masks.causal()) == {"_Rows"}
    assert kinds(masks.sliding_window(256)) == {"_Windows"}
    assert kinds(masks.document(torch.arange(1024) // 128)) == {"_Windows"}
    assert kinds(masks.sliding_window(1000)) == {"_Rows"}  # windows would not save half


def test_extra_memory_stays_linear():
    """Autograd keeps q, k, v, out and the lse: no T × S tensor, unlike the reference."""
    T = 1024
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        dikkat.attention(q, k, v, masks.causal(), backend="tiled")
    assert max(saved) <= 2 * T * 16  # the biggest saved tensor is (B, H, T, D)-sized
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        dikkat.attention(q, k, v, masks.causal(), backend="reference")
    assert max(saved) >= 2 * T * T  # the reference keeps the (B, H, T, S) weights


def test_return_lse_and_refusals():
    q = k = v = torch.randn(1, 2, 5, 8)
    _, lse = dikkat.attention(q, k, v, masks.causal(), backend="tiled", return_lse=True)
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="use return_lse"):
        dikkat.attention(q, k, v, backend="tiled", return_weights=True)
    with pytest.raises(ValueError, match="no dropout"):
        dikkat.attention(q, k, v, backend="tiled", dropout=0.1)
    with pytest.raises(ValueError, match="cannot return the log-sum-exp"):
        dikkat.attention(q, k, v, backend="sdpa", return_lse=True)
    for name in ("block", "key_tile", "cells"):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            tiled.tiled_attention(q, k, v, scale=1.0, **{name: 0})


@given(case=attention_cases(max_len=40), data=st.data())
def test_kv_range_bounds_every_visible_key(case, data):
    """No mask allows a key outside the range it reports (the tiled backend relies on it)."""
    if case.mask is None:
        return
    mask = as_mask(case.mask, case.q_offset)
    a = data.draw(st.integers(0, case.T - 1))
    b = data.draw(st.integers(a + 1, case.T))
    q0, q1 = case.q_offset + a, case.q_offset + b
    lo, hi = mask.kv_range(q0, q1, case.S)
    allowed = case.allowed()[:, :, a:b]  # (B, H, b − a, S)
    visible = allowed.any(dim=(0, 1, 2)).nonzero().flatten().tolist()
    assert all(lo <= j < hi for j in visible), (lo, hi, visible)


@given(case=attention_cases(max_len=30), data=st.data())
def test_attention_weights_from_the_lse_equal_the_reference(case, data):
    """Chosen rows and heads, recomputed from the tiled backend's lse, = the reference weights."""
    inputs = case.inputs()
    q, k, v, bias = inputs["q"], inputs["k"], inputs["v"], inputs["bias"]
    kwargs = {"bias": bias, "q_offset": case.q_offset}
    _, lse = dikkat.attention(q, k, v, case.mask, backend="tiled", return_lse=True, **kwargs)
    _, ref = dikkat.attention(
        q, k, v, case.mask, backend="reference", return_weights=True, **kwargs
    )
    rows = data.draw(st.lists(st.integers(0, case.T - 1), min_size=1, max_size=4))
    heads = data.draw(st.lists(st.integers(0, case.H - 1), min_size=1, max_size=3))
    w = dikkat.attention_weights(q, k, lse, rows=rows, heads=heads, mask=case.mask, **kwargs)
    assert w.shape == (case.B, len(heads), len(rows), case.S)
    torch.testing.assert_close(w, ref[:, heads][:, :, rows], atol=1e-12, rtol=1e-10)


def test_attention_weights_bad_input():
    q = k = torch.randn(1, 2, 4, 8)
    lse = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="lse must have shape"):
        dikkat.attention_weights(q, k, lse[..., :3])
    with pytest.raises(ValueError, match="rows must index 0 … 3"):
        dikkat.attention_weights(q, k, lse, rows=[4])
    with pytest.raises(ValueError, match="heads must index 0 … 1"):
        dikkat.attention_weights(q, k, lse, heads=[-1])


def test_auto_sends_mostly_hidden_masks_to_tiled():
    q, k, v = (torch.randn(1, 1, 1024, 16) for _ in range(3))
    window = masks.sliding_window(64)
    assert dikkat.explain(q, k, v, window).startswith("tiled (not sdpa: the mask leaves at most")
    assert dikkat.explain(q, k, v, masks.causal()).startswith("sdpa")  # SDPA's causal kernel
    assert dikkat.explain(q, k, v).startswith("sdpa")
    small = q[:, :, :64], k[:, :, :64], v[:, :, :64]
    assert dikkat.explain(*small, window).startswith("sdpa")  # too small to matter
    torch.testing.assert_close(
        dikkat.attention(q, k, v, window), dikkat.attention(q, k, v, window, backend="tiled")
    )


def _qkv(n: int, seed: int = 0, heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def test_masks_are_prepared_once_and_rebuilt_when_they_change():
    """A repeated call with an equal mask reuses the plan and its tile masks; a mask tensor
    changed in place, or a mask type of the caller's own, is evaluated again."""
    tiled._prepared.clear()
    n = 512
    q, k, v = _qkv(n)
    ids = torch.arange(n) // 100
    docs = masks.document(ids)
    first = tiled.tiled_attention(q, k, v, docs, scale=0.3, block=32)[0]
    builds = tiled._prepared.builds
    again = tiled.tiled_attention(q, k, v, masks.document(ids), scale=0.3, block=32)[0]
    assert tiled._prepared.builds == builds and torch.equal(first, again)
    ids.copy_(torch.arange(n) // 50)  # the same tensor, new documents
    changed = tiled.tiled_attention(q, k, v, docs, scale=0.3, block=32)[0]
    assert tiled._prepared.builds == builds + 1
    ref = dikkat.attention(q, k, v, masks.document(ids.clone()), backend="reference", scale=0.3)
    torch.testing.assert_close(changed, ref, rtol=1e-10, atol=1e-10)

    class Lower(masks.Mask):  # a mask of the caller's own: never cached
        def predicate(self, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    builds = tiled._prepared.builds
    lower = Lower()
    for _ in range(2):
        tiled.tiled_attention(q, k, v, lower, scale=0.3, block=32)
    assert tiled._prepared.builds == builds + 2


def test_window_tiles_keep_one_block_pattern():
    """Every block of a sliding window sees the same pattern over its own window: the kept
    masks hold one block's worth per tile, not one per block."""
    tiled._prepared.clear()
    n, w = 4096, 256
    q, k, v = _qkv(n)
    tiled.tiled_attention(q, k, v, masks.sliding_window(w), scale=0.3)
    ((_, prepared),) = tiled._prepared._entries.values()
    block = prepared.block
    assert block == tiled.BLOCK // 2  # a narrow band: half-size blocks compute fewer cells
    one_block_each = sum(block * item.width * 8 for item in prepared.plan)  # fp64
    assert sum(item.starts.numel() for item in prepared.plan) == n // block
    assert 0 < prepared.masks.nbytes <= one_block_each < n * w * 8 / 8


@pytest.mark.parametrize("kept", [0, 1 << 30])
def test_unkept_masks_give_the_same_result(monkeypatch, kept: int):
    """Tile masks rebuilt at every use (nothing kept) or all kept: bit-identical results."""
    n = 300
    q, k, v = (t.requires_grad_() for t in _qkv(n, seed=3))
    dout = torch.randn(1, 2, n, 8, dtype=torch.float64)
    runs = []
    for limit in (kept, 16 << 20):
        tiled._prepared.clear()
        monkeypatch.setattr(tiled, "KEPT_MASK_BYTES", limit)
        for mask in (masks.sliding_window(40), masks.causal(), masks.prefix_lm(70)):
            out, _ = tiled.tiled_attention(q, k, v, mask, scale=0.3, block=16, key_tile=64)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    half = len(runs) // 2
    for a, b in zip(runs[:half], runs[half:], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_block_size_follows_the_cells_it_saves():
    """Windows pick the block size with the least kernel time (cells over the kernel's speed at
    that many rows): small blocks for a narrow band, large ones for 1024-token documents."""
    choose = tiled._choose_block
    n = 8192
    args = (8, n, n, 0, tiled.CELLS, tiled.KEY_TILE, None)
    assert choose(masks.sliding_window(256), *args) == tiled.BLOCK // 2
    assert choose(masks.document(torch.arange(n) // 1024), *args) == 2 * tiled.BLOCK
    assert choose(masks.causal(), *args) == choose(None, *args) == tiled.BLOCK
    assert choose(masks.sliding_window(256), *args[:-1], False) == tiled.BLOCK
