"""What ``causal()`` means when T ≠ S: query i sits at position ``q_offset + i`` among the keys.

``q_offset = 0`` aligns the queries with the first keys (top-left, PyTorch's ``is_causal`` and
``torch.nn.attention.bias.causal_upper_left``); ``q_offset = S − T`` with the last keys
(bottom-right, ``causal_lower_right``, flash-attention ≥ 2.1's causal, a decoding step after a
cache). Both are checked against PyTorch's own causal biases, in fp64, on every backend that
serves the call (docs/attention.md, "Causal masks when T ≠ S").
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import dikkat
from dikkat import masks

BACKENDS = ("reference", "tiled", "sdpa", "auto")


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


def test_bottom_right_with_more_queries_than_keys_is_refused_by_name():
    """T > S bottom-right would need a negative offset (the first T − S queries see nothing);
    it is refused, naming the argument, rather than read as something else."""
    q, k, v = qkv(5, 3, seed=0)
    with pytest.raises(ValueError, match="q_offset"):
        dikkat.attention(q, k, v, masks.causal(), q_offset=3 - 5)
