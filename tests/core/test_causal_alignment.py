"""What ``causal()`` means when T ≠ S: query i sits at position ``q_offset + i`` among the keys.

``q_offset = 0`` aligns the queries with the first keys (top-left, PyTorch's ``is_causal`` and
``torch.nn.attention.bias.causal_upper_left``); ``q_offset = S − T`` with the last keys
(bottom-right, ``causal_lower_right``, flash-attention ≥ 2.1's causal, a decoding step after a
cache) — negative when T > S, where the first T − S queries see no key (output 0, lse −inf).
Both are checked against PyTorch's own causal biases, in fp64, on every backend that serves the
call (docs/attention.md, "Causal masks when T ≠ S").
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import dikkat
from dikkat import masks

HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
BACKENDS = ("reference", "tiled", "sdpa", "auto", *(("flex",) if HAS_FLEX else ()))


def qkv(T: int, S: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, n, 16, generator=g, dtype=torch.float64) for n in (T, S, S))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("T", "S"), [(3, 5), (1, 9), (7, 200), (130, 131), (64, 64)])
def test_causal_with_q_offset_s_minus_t_is_bottom_right(backend, T, S):
    q, k, v = qkv(T, S, seed=T * 1000 + S)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))
    got = dikkat.attention(q, k, v, masks.causal(), q_offset=S - T, backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("T", "S"), [(3, 5), (7, 200), (130, 131)])
def test_causal_with_q_offset_zero_is_top_left(backend, T, S):
    q, k, v = qkv(T, S, seed=T + S)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(T, S))
    got = dikkat.attention(q, k, v, masks.causal(), backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("T", "S"), [(5, 3), (9, 1), (200, 7), (131, 130)])
def test_bottom_right_with_more_queries_than_keys(backend, T, S):
    """T > S bottom-right: q_offset = S − T < 0. Query i sees keys j ≤ i − (T − S), so the first
    T − S queries see none: output 0 (PyTorch's causal_lower_right warns it may give NaN there;
    dikkat's rule for a row with no key is 0, on every backend), and a gradient of 0 to q."""
    q, k, v = (t.requires_grad_() for t in qkv(T, S, seed=T * 1000 + S))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))
    expected = expected.nan_to_num(0.0)
    got = dikkat.attention(q, k, v, masks.causal(), q_offset=S - T, backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert (got[:, :, : T - S] == 0).all()
    dout = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want = torch.autograd.grad(expected, (q, k, v), dout)
    assert (grads[0][:, :, : T - S] == 0).all()
    for name, a, b in zip("qkv", grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_queries_before_key_0_have_lse_minus_inf(backend):
    T, S = 6, 4
    q, k, v = qkv(T, S, seed=5)
    _, (_, lse) = dikkat.attention(
        q, k, v, masks.causal(), q_offset=S - T, backend=backend, return_lse=True
    )
    assert torch.isneginf(lse[:, :, : T - S]).all() and torch.isfinite(lse[:, :, T - S :]).all()


def test_weights_of_queries_before_key_0_are_zero():
    T, S = 6, 4
    q, k, v = qkv(T, S, seed=6)
    _, (weights, lse) = dikkat.attention(
        q, k, v, masks.causal(), q_offset=S - T, return_weights=True, return_lse=True
    )
    assert (weights[:, :, : T - S] == 0).all()
    again = dikkat.attention_weights(q, k, lse, mask=masks.causal(), q_offset=S - T)
    torch.testing.assert_close(again, weights, rtol=1e-12, atol=1e-12)


def test_top_left_equals_bottom_right_shifted_by_s_minus_t():
    """The two alignments are one mask at two offsets: the rows of a bottom-right call are those
    of a top-left call over the queries' own positions."""
    T, S = 7, 4
    q, k, v = qkv(T, S, seed=7)
    bottom = dikkat.attention(q, k, v, masks.causal(), q_offset=S - T, backend="reference")
    allowed = torch.arange(T)[:, None] - (T - S) >= torch.arange(S)  # j ≤ i − (T − S)
    dense = dikkat.attention(q, k, v, allowed, backend="reference")
    torch.testing.assert_close(bottom, dense, rtol=0, atol=0)
