"""The tiled backend with many tiles: exact in fp64, masked tiles skipped, lse, O(n) memory.

``test_backends.py`` runs every backend (this one included) under the 2× error rule on short
sequences, which fit in one 128 × 128 tile; here small tiles force the online-softmax rescaling,
tile skipping and per-tile masks through every mask kind.
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


def run_tiled(case: Case, inputs, block: int):
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
    )
    grads = torch.autograd.grad(out, (q, k, v), inputs["dout"])
    return out.detach(), lse, grads


@given(case=attention_cases(max_len=40), block=st.sampled_from([1, 3, 8, 16]))
def test_many_tiles_equal_the_fp64_reference(case, block):
    inputs = case.inputs()
    exact = oracle(case, inputs, torch.float64)
    out, lse, (dq, dk, dv) = run_tiled(case, inputs, block)
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


def count_tiles(mask, T: int, S: int, block: int) -> int:
    """How many tiles the forward pass computes (the others are skipped)."""
    return sum(
        tiled._tile_mask(mask, 1, 1, 1, q0, min(q0 + block, T), k0, min(k0 + block, S), "cpu")
        is not False
        for q0 in range(0, T, block)
        for k0 in range(0, S, block)
    )


def test_masked_tiles_are_skipped():
    n, b = 1024, 64
    tiles = (n // b) ** 2
    assert count_tiles(None, n, n, b) == tiles
    assert count_tiles(masks.causal(), n, n, b) == (n // b) * (n // b + 1) // 2  # about half
    window = count_tiles(masks.sliding_window(b), n, n, b)
    assert window == 2 * (n // b) - 1  # linear in n: the diagonal and the one below it
    docs = masks.document(torch.arange(n) // (n // 4))  # 4 packed documents
    assert count_tiles(docs, n, n, b) == 4 * (n // b // 4) * (n // b // 4 + 1) // 2
    # and the loop does not even visit the hidden tiles: a few key blocks per query block
    for mask in (masks.sliding_window(b), docs):
        visits = [len(tiled._key_blocks(mask, q0, q0 + b, n, b)) for q0 in range(0, n, b)]
        assert max(visits) <= (2 if mask is not docs else n // b // 4)


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
    with pytest.raises(ValueError, match="block must be positive"):
        tiled.tiled_attention(q, k, v, scale=1.0, block=0)


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
