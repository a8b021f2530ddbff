"""KVCache: in-place updates, views, length, reset, errors, and its size in bytes (docs/contract.md
§7, §17).

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``S_max`` capacity, ``T`` new
tokens, ``D`` head dim.
"""

from __future__ import annotations

import pytest
import torch

from dikkat.generation import KVCache
from dikkat.layers.kv_cache import AttendingCache
from dikkat.models import GPT, GPTConfig

B, G, S_MAX, D = 2, 3, 10, 4


def kv(T: int, seed: int, *, batch: int = B, heads: int = G, dim: int = D):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, heads, T, dim, generator=g),
        torch.randn(batch, heads, T, dim, generator=g),
    )


def test_update_returns_every_filled_slot_in_order():
    cache = KVCache(B, G, S_MAX, D)
    k1, v1 = kv(4, seed=0)
    k2, v2 = kv(1, seed=1)
    k3, v3 = kv(3, seed=2)
    cache.update(0, k1, v1)
    cache.update(4, k2, v2)
    k, v = cache.update(5, k3, v3)
    assert cache.length == 8
    assert k.shape == v.shape == (B, G, 8, D)
    assert torch.equal(k, torch.cat([k1, k2, k3], dim=2))
    assert torch.equal(v, torch.cat([v1, v2, v3], dim=2))
    # slots past the filled length are untouched zeros
    assert not cache.k[:, :, 8:].any() and not cache.v[:, :, 8:].any()


def test_update_returns_views_of_the_preallocated_buffers():
    cache = KVCache(B, G, S_MAX, D)
    ptr_k, ptr_v = cache.k.data_ptr(), cache.v.data_ptr()
    k, v = cache.update(0, *kv(3, seed=0))
    assert k.data_ptr() == ptr_k and v.data_ptr() == ptr_v  # no copy, no re-allocation
    cache.update(3, *kv(2, seed=1))
    assert cache.k.data_ptr() == ptr_k and cache.v.data_ptr() == ptr_v
    assert cache.k.shape == cache.v.shape == (B, G, S_MAX, D)


def test_length_grows_by_the_tokens_written():
    cache = KVCache(B, G, S_MAX, D)
    assert cache.length == 0 and cache.max_len == S_MAX
    expected = 0
    for step, T in enumerate((3, 1, 1, 2)):
        cache.update(expected, *kv(T, seed=step))
        expected += T
        assert cache.length == expected


def test_rewriting_below_the_length_overwrites_and_truncates():
    cache = KVCache(B, G, S_MAX, D)
    k1, v1 = kv(6, seed=0)
    cache.update(0, k1, v1)
    k2, v2 = kv(2, seed=1)
    k, v = cache.update(2, k2, v2)
    assert cache.length == 4
    assert torch.equal(k, torch.cat([k1[:, :, :2], k2], dim=2))
    assert torch.equal(v, torch.cat([v1[:, :, :2], v2], dim=2))


def test_reset_empties_the_cache_for_a_new_prompt():
    cache = KVCache(B, G, S_MAX, D)
    cache.update(0, *kv(5, seed=0))
    cache.reset()
    assert cache.length == 0
    with pytest.raises(ValueError, match="start"):
        cache.update(1, *kv(1, seed=1))  # slot 0 is no longer filled
    k_new, v_new = kv(2, seed=2)
    k, v = cache.update(0, k_new, v_new)
    assert cache.length == 2
    assert torch.equal(k, k_new) and torch.equal(v, v_new)


def test_filling_to_capacity_works_and_one_more_token_overflows():
    cache = KVCache(B, G, S_MAX, D)
    cache.update(0, *kv(S_MAX - 1, seed=0))
    k, _ = cache.update(S_MAX - 1, *kv(1, seed=1))
    assert k.shape[2] == S_MAX == cache.length
    with pytest.raises(ValueError, match="full"):
        cache.update(S_MAX, *kv(1, seed=2))
    assert cache.length == S_MAX


def test_a_prefill_longer_than_the_cache_overflows_and_leaves_it_empty():
    cache = KVCache(B, G, S_MAX, D)
    with pytest.raises(ValueError, match="full"):
        cache.update(0, *kv(S_MAX + 1, seed=0))
    assert cache.length == 0


def test_start_beyond_the_filled_length_is_an_error():
    cache = KVCache(B, G, S_MAX, D)
    cache.update(0, *kv(3, seed=0))
    for start in (4, S_MAX, -1):
        with pytest.raises(ValueError, match="start"):
            cache.update(start, *kv(1, seed=1))
    assert cache.length == 3


@pytest.mark.parametrize(
    "shape",
    [
        (B + 1, G, 1, D),  # wrong batch
        (B, G + 1, 1, D),  # wrong number of key/value heads
        (B, G, 1, D + 1),  # wrong head dim
        (B, G, D),  # 3-D
        (1, B, G, 1, D),  # 5-D
        (B, G),  # 2-D
    ],
)
def test_keys_of_the_wrong_shape_are_rejected(shape):
    cache = KVCache(B, G, S_MAX, D)
    with pytest.raises(ValueError, match="shape"):
        cache.update(0, torch.zeros(shape), torch.zeros(shape))
    assert cache.length == 0


def test_keys_and_values_of_different_shapes_are_rejected():
    cache = KVCache(B, G, S_MAX, D)
    k, _ = kv(2, seed=0)
    _, v = kv(3, seed=1)
    with pytest.raises(ValueError, match="one shape"):
        cache.update(0, k, v)


@pytest.mark.parametrize(
    "sizes", [(0, G, S_MAX, D), (B, 0, S_MAX, D), (B, G, 0, D), (B, G, S_MAX, -1)]
)
def test_non_positive_sizes_are_rejected(sizes):
    with pytest.raises(ValueError, match="positive"):
        KVCache(*sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nbytes_is_two_tensors_of_b_g_smax_d_elements(dtype):
    cache = KVCache(B, G, S_MAX, D, dtype=dtype)
    itemsize = torch.finfo(dtype).bits // 8
    assert cache.nbytes == 2 * B * G * S_MAX * D * itemsize
    assert cache.k.dtype == cache.v.dtype == dtype


def test_nbytes_does_not_change_while_filling():
    cache = KVCache(B, G, S_MAX, D)
    before = cache.nbytes
    cache.update(0, *kv(S_MAX, seed=0))
    assert cache.nbytes == before


@pytest.mark.parametrize("H, G_kv", [(8, 2), (8, 1), (6, 3)])
def test_gqa_cache_is_h_over_g_times_smaller(H, G_kv):
    base = dict(vocab_size=32, max_len=24, d_model=48, n_layers=3, n_heads=H)
    mha = GPT(GPTConfig(**base)).new_cache(batch=2)
    gqa = GPT(GPTConfig(**base, n_kv_heads=G_kv)).new_cache(batch=2)
    mha_bytes = sum(c.nbytes for c in mha)
    gqa_bytes = sum(c.nbytes for c in gqa)
    assert gqa_bytes * (H // G_kv) == mha_bytes
    assert gqa_bytes < mha_bytes
    # and each layer's cache is (B, G, S_max, D) in the model's dtype
    assert len(gqa) == 3
    head_dim = 48 // H
    for c in gqa:
        assert c.k.shape == (2, G_kv, 24, head_dim)
    assert gqa_bytes == 3 * 2 * 2 * G_kv * 24 * head_dim * 4


def test_new_cache_honours_max_len_dtype_and_the_context_limit():
    model = GPT(GPTConfig(vocab_size=32, max_len=16, d_model=32, n_layers=2, n_heads=4))
    caches = model.new_cache(3, 8, dtype=torch.float16)
    assert all(c.k.shape == (3, 4, 8, 8) and c.k.dtype == torch.float16 for c in caches)
    with pytest.raises(ValueError, match="context"):
        model.new_cache(1, 17)


class _Recording:
    """A SelfAttentionCache that keeps its slots in a KVCache of its own and logs each call."""

    def __init__(self, inner: KVCache) -> None:
        self.inner, self.calls = inner, []

    def update(self, start, k, v):
        self.calls.append((start, k.shape[2]))
        return self.inner.update(start, k, v)


def test_gpt_decodes_through_any_self_attention_cache():
    """GPT takes any object with ``update(start, k, v)`` per layer: a wrapper around KVCache
    gives the cached logits, which equal the full forward's (fp64)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, max_len=12, d_model=16, n_layers=2, n_heads=2))
    model = model.double().eval()
    ids = torch.randint(0, 17, (2, 7))
    caches = [_Recording(c) for c in model.new_cache(2, 7)]
    with torch.no_grad():
        full = model(ids)
        first = model(ids[:, :5], cache=caches)
        steps = [model(ids[:, t : t + 1], offset=t, cache=caches) for t in (5, 6)]
    got = torch.cat([first, *steps], dim=1)
    assert torch.allclose(got, full, atol=1e-12, rtol=0)
    assert caches[0].calls == caches[1].calls == [(0, 5), (5, 1), (6, 1)]


def test_cross_attention_keeps_its_keys_in_a_kv_cache_only():
    from dikkat.layers import MultiHeadAttention

    mha = MultiHeadAttention(8, 2)
    x, context = torch.randn(1, 3, 8), torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match="cross-attention keeps its keys in a KVCache"):
        mha(x, context, cache=_Recording(KVCache(1, 2, 4, 4)))


class _SDPASlots(AttendingCache):
    """An attending cache as a decode step writes one: a KVCache's buffers, attended by SDPA
    (grouped heads repeated), the queries at the last filled slots."""

    def __init__(self, cache: KVCache, start: int) -> None:
        self.cache, self.start, self.calls = cache, start, 0

    def attend(self, q, k, v, scale, softcap=None):
        assert softcap is None
        self.calls += 1
        k, v = self.cache.update(self.start, k, v)
        H, G = q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, causal, scale=scale)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_a_cache_that_attends_itself_gets_the_layers_own_forward(position):
    """The projections, q/k norms, RoPE and output projection stay the layer's: only the store
    and the kernel are the cache's (what the compiled decode steps hand in)."""
    torch.manual_seed(0)
    V = 50
    config = GPTConfig(vocab_size=V, max_len=16, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, position=position)  # fmt: skip
    model = GPT(config).eval()
    ids = torch.randint(0, V, (1, 7))
    eager, own = model.new_cache(1, 8), model.new_cache(1, 8)
    with torch.no_grad():
        want = model(ids[:, :6], cache=eager)
        want = torch.cat([want, model(ids[:, 6:], offset=6, cache=eager)], 1)
        slots = [_SDPASlots(c, 0) for c in own]
        got = model.run(ids[:, :6], None, cache=slots)
        for s in slots:
            s.start = 6
        got = torch.cat([got, model.run(ids[:, 6:], None, offset=6, cache=slots)], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [s.calls for s in slots] == [2, 2]
    with pytest.raises(ValueError, match="returns no weights"):
        model.blocks[0].attn(torch.randn(1, 1, 32), cache=slots[0], return_weights=True)
