"""Linear attention against its own quadratic formula; the recurrent form; what it refuses."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dikkat
from dikkat import masks
from dikkat.core.linear import (
    LinearState,
    feature_map,
    linear_attention,
    linear_attention_quadratic,
    linear_attention_step,
)


def qkv(B, H, G, T, S, D, Dv, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(B, H, T, D), r(B, G, S, D), r(B, G, S, Dv)


def by_hand(q, k, v, causal):
    """φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j'), written as loops (the model's definition)."""
    B, H, T, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            kh = h // (H // G)
            for i in range(T):
                keys = range(S - T + i + 1) if causal else range(S)
                w = torch.stack([feature_map(q[b, h, i]) @ feature_map(k[b, kh, j]) for j in keys])
                out[b, h, i] = (w / w.sum()) @ v[b, kh, : len(w)]
    return out


@given(
    B=st.integers(1, 2),
    G=st.integers(1, 2),
    group=st.integers(1, 2),
    T=st.integers(1, 20),
    extra=st.integers(0, 5),
    D=st.sampled_from([4, 8]),
    Dv=st.sampled_from([4, 6]),
    chunk=st.integers(1, 8),
    segment=st.integers(1, 24),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_and_parallel_forms_equal_the_definition(
    B, G, group, T, extra, D, Dv, chunk, segment, seed
):
    """Chunks within segments within the sequence: every cut gives the definition."""
    H, S = G * group, T + extra
    q, k, v = qkv(B, H, G, T, S, D, Dv, seed)
    for causal in (False, True):
        expected = by_hand(q, k, v, causal)
        torch.testing.assert_close(linear_attention_quadratic(q, k, v, causal=causal), expected)
        got = linear_attention(q, k, v, causal=causal, chunk=chunk, segment=segment)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_backend_and_recurrent_form():
    q, k, v = qkv(2, 4, 2, 70, 70, 8, 8, 0)
    torch.testing.assert_close(
        dikkat.attention(q, k, v, masks.causal(), backend="linear"),
        linear_attention_quadratic(q, k, v, causal=True),
    )
    state = LinearState.empty(2, 2, 8, 8, dtype=torch.float64)
    steps = [
        linear_attention_step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        for t in range(70)
    ]
    torch.testing.assert_close(
        torch.cat(steps, 2), linear_attention_quadratic(q, k, v, causal=True)
    )
    assert state.nbytes == 2 * 2 * (8 * 8 + 8) * 8  # constant: no growth with the sequence
    # cached decoding: the last query at q_offset = S − 1 sees every key
    last = dikkat.attention(q[:, :, -1:], k, v, masks.causal(), q_offset=69, backend="linear")
    torch.testing.assert_close(last, steps[-1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mask": masks.sliding_window(4)}, "no mask or causal"),
        ({"mask": masks.causal(), "q_offset": 2}, "queries to be the last keys"),
        ({"bias": torch.zeros(1, 1, 6, 6)}, "no bias"),
        ({"dropout": 0.1}, "no dropout"),
        ({"return_weights": True}, "no weights"),
    ],
)
def test_linear_refuses_what_does_not_factorise(kwargs, message):
    q = k = v = torch.randn(1, 2, 6, 4)
    mask = kwargs.pop("mask", None)
    with pytest.raises(ValueError, match=message):
        dikkat.attention(q, k, v, mask, backend="linear", **kwargs)


def test_linear_is_never_picked_by_auto():
    q = k = v = torch.randn(1, 2, 8, 4)
    assert "linear" not in dikkat.explain(q, k, v).split(" ")[0]
    assert "linear" not in dikkat.available_backends(exact_only=True)
    assert "linear" in dikkat.available_backends()


def test_bad_chunk_or_segment():
    q, k, v = qkv(1, 2, 2, 4, 4, 4, 4, 0)
    for bad in ({"chunk": 0}, {"segment": -1}):
        with pytest.raises(ValueError, match="chunk and segment must be positive"):
            linear_attention(q, k, v, causal=True, **bad)
