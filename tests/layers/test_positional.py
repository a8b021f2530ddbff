"""Position information (§8): without it attention cannot see order; with it, it can.

Notation: ``B`` batch, ``H`` heads, ``T`` length, ``D`` head dim, ``C`` model width.

Expected values come from the papers' formulas written out here in float64 (``math`` and plain
loops), never from the module under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from dikkat import (
    ALiBi,
    Block,
    BlockConfig,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    masks,
)
from dikkat.layers import alibi_slopes
from dikkat.layers.positional import resolve_positions, sinusoidal_table, valid_positions

PERM = torch.tensor([3, 0, 6, 4, 1, 7, 2, 5])  # T = 8, no token stays in place


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def shuffle_gap(f, x: Tensor) -> float:
    """max |f(x[:, perm]) − f(x)[:, perm]|: 0 exactly when f only shuffles its outputs."""
    with torch.no_grad():
        return (f(x[:, PERM]) - f(x)[:, PERM]).abs().max().item()


# --- §8: permutation equivariance without positions, and not with them --------------------------


def test_attention_without_positions_is_permutation_equivariant():
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4).double()
    block = Block(BlockConfig(d_model=32, n_heads=4)).double().eval()
    x = randn(2, 8, 32, seed=1)
    assert shuffle_gap(layer, x) < 1e-12
    assert shuffle_gap(block, x) < 1e-12
    # the shuffle itself is not trivial: outputs do move
    with torch.no_grad():
        assert not torch.allclose(layer(x[:, PERM]), layer(x), atol=1e-3)


def test_added_positions_break_permutation_equivariance():
    torch.manual_seed(1)
    layer = MultiHeadAttention(32, 4).double()
    sin = SinusoidalPositionalEncoding(32, max_len=16)
    learned = LearnedPositionalEmbedding(16, 32).double()
    with torch.no_grad():
        learned.weight.normal_()  # trained embeddings, not the 0.02-scale initialisation
    x = randn(2, 8, 32, seed=2)
    assert shuffle_gap(lambda t: layer(sin(t)), x) > 1e-2
    assert shuffle_gap(lambda t: layer(learned(t)), x) > 1e-2
    # and through a whole block
    block = Block(BlockConfig(d_model=32, n_heads=4)).double().eval()
    assert shuffle_gap(block, x) < 1e-12
    assert shuffle_gap(lambda t: block(sin(t)), x) > 1e-2


@pytest.mark.parametrize("kind", ["rope", "alibi", "alibi-symmetric"])
def test_positions_inside_attention_break_permutation_equivariance(kind):
    torch.manual_seed(2)
    C, H = 32, 4
    position = {
        "rope": {"rope": RotaryEmbedding(C // H)},
        "alibi": {"alibi": ALiBi(H)},
        "alibi-symmetric": {"alibi": ALiBi(H, symmetric=True)},
    }[kind]
    layer = MultiHeadAttention(C, H, **position).double()
    plain = MultiHeadAttention(C, H).double()
    plain.load_state_dict(layer.state_dict())  # same weights, no positions
    x = randn(2, 8, C, seed=3)
    assert shuffle_gap(plain, x) < 1e-12
    assert shuffle_gap(layer, x) > 1e-2
    block = Block(BlockConfig(d_model=C, n_heads=H), **position).double().eval()
    assert shuffle_gap(block, x) > 1e-2


@pytest.mark.parametrize("kind", ["rope", "alibi"])
def test_relative_positions_make_a_layer_shift_invariant(kind):
    """RoPE and ALiBi see only i − j: shifting every position by the same offset changes nothing.

    Added (absolute) positions do not have this property, which the last assertion checks.
    """
    torch.manual_seed(3)
    C, H = 32, 4
    position = {"rope": {"rope": RotaryEmbedding(C // H)}, "alibi": {"alibi": ALiBi(H)}}[kind]
    layer = MultiHeadAttention(C, H, **position).double()
    x = randn(2, 6, C, seed=4)
    with torch.no_grad():
        base = layer(x, mask=masks.causal())
        shifted = layer(x, mask=masks.causal(), offset=37)
        explicit = layer(x, mask=masks.causal(), positions=torch.arange(100, 106))
    tol = 1e-5 if kind == "rope" else 1e-12  # RoPE's cos/sin tables are float32
    torch.testing.assert_close(shifted, base, atol=tol, rtol=0)
    torch.testing.assert_close(explicit, base, atol=tol, rtol=0)
    sin = SinusoidalPositionalEncoding(C, max_len=64)
    with torch.no_grad():
        plain = MultiHeadAttention(C, H).double()
        gap = (plain(sin(x, offset=37)) - plain(sin(x))).abs().max().item()
    assert gap > 1e-2


# --- sinusoidal -----------------------------------------------------------------------------------


def paper_pe(pos: int, j: int, d: int) -> float:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    i = j // 2
    angle = pos / 10000 ** (2 * i / d)
    return math.sin(angle) if j % 2 == 0 else math.cos(angle)


@pytest.mark.parametrize(("max_len", "d"), [(50, 16), (4096, 8)])
def test_sinusoidal_table_is_the_paper_formula(max_len, d):
    table = sinusoidal_table(max_len, d)
    assert table.shape == (max_len, d)
    rows = sorted({0, 1, 2, 17, max_len // 2, max_len - 1})
    expected = torch.tensor([[paper_pe(p, j, d) for j in range(d)] for p in rows])
    # stored in float32: within float32 rounding of the exact value
    torch.testing.assert_close(table[rows].double(), expected.double(), atol=1e-7, rtol=0)
    enc = SinusoidalPositionalEncoding(d, max_len=max_len)
    torch.testing.assert_close(enc.table[rows].double(), expected.double(), atol=1e-7, rtol=0)
    assert len(list(enc.parameters())) == 0  # fixed vectors, nothing to learn


def test_sinusoidal_adds_offset_and_explicit_positions():
    d, T = 12, 5
    enc = SinusoidalPositionalEncoding(d, max_len=32)
    x = randn(2, T, d, seed=5)

    def expected(positions: list[list[int]]) -> Tensor:
        pe = torch.tensor(
            [[[paper_pe(p, j, d) for j in range(d)] for p in row] for row in positions]
        )
        return x + pe.double()

    torch.testing.assert_close(enc(x), expected([list(range(T))] * 2), atol=1e-7, rtol=0)
    torch.testing.assert_close(
        enc(x, offset=9), expected([list(range(9, 9 + T))] * 2), atol=1e-7, rtol=0
    )
    torch.testing.assert_close(
        enc(x, positions=torch.tensor([4, 0, 31, 2, 2])),
        expected([[4, 0, 31, 2, 2]] * 2),
        atol=1e-7,
        rtol=0,
    )
    per_row = [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]  # (B, T)
    torch.testing.assert_close(
        enc(x, positions=torch.tensor(per_row)), expected(per_row), atol=1e-7, rtol=0
    )
    assert enc(x.float()).dtype == torch.float32


def test_positions_past_max_len_raise():
    enc = SinusoidalPositionalEncoding(8, max_len=10)
    learned = LearnedPositionalEmbedding(10, 8)
    x = torch.zeros(1, 4, 8)
    for module in (enc, learned):
        module(x, offset=6)  # positions 6 … 9: the last fits
        with pytest.raises(ValueError, match="holds positions 0 … 9, got positions 7 … 10"):
            module(x, offset=7)
        with pytest.raises(ValueError, match="got positions 0 … 12"):
            module(x, positions=torch.tensor([0, 1, 12, 3]))
        with pytest.raises(ValueError, match="got positions -1 … 3"):
            module(x, positions=torch.tensor([0, -1, 2, 3]))
    with pytest.raises(ValueError, match="RotaryEmbedding"):
        RotaryEmbedding(4, max_len=10).rotate(torch.zeros(1, 1, 4, 4), torch.arange(8, 12))


def test_bad_positions_arguments():
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        resolve_positions(4, offset=-1)
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        resolve_positions(4, offset=1.5)
    with pytest.raises(TypeError, match="integer tensor"):
        resolve_positions(4, positions=torch.arange(4.0))
    with pytest.raises(TypeError, match="integer tensor"):  # would index as a mask
        resolve_positions(4, positions=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"T=4, got \(5,\)"):
        resolve_positions(4, positions=torch.arange(5))
    with pytest.raises(ValueError, match="even d_model"):
        SinusoidalPositionalEncoding(7)


def test_learned_positions_add_their_rows():
    torch.manual_seed(4)
    emb = LearnedPositionalEmbedding(20, 6).double()
    assert emb.weight.requires_grad and emb.weight.shape == (20, 6)
    x = randn(2, 3, 6, seed=6)
    w = emb.weight.detach()
    torch.testing.assert_close(emb(x), x + w[:3], atol=0, rtol=0)
    torch.testing.assert_close(emb(x, offset=5), x + w[5:8], atol=0, rtol=0)
    pos = torch.tensor([[2, 9, 4], [0, 0, 19]])
    expected = torch.stack([x[b] + torch.stack([w[p] for p in pos[b].tolist()]) for b in range(2)])
    torch.testing.assert_close(emb(x, positions=pos), expected, atol=0, rtol=0)


# --- RoPE -----------------------------------------------------------------------------------------


def rope_fp64(
    x: Tensor, positions: list[int], base: float = 10000.0, divisors: list[float] | None = None
) -> Tensor:
    """Rotate-half RoPE in float64: pair (x_i, x_{i+D/2}) turns by pos · base^(−2i/D), divided
    by ``divisors[i]`` where given (RoPE scaling)."""
    D = x.shape[-1]
    out = torch.empty_like(x, dtype=torch.float64)
    for t, pos in enumerate(positions):
        for i in range(D // 2):
            a = pos * base ** (-2 * i / D) / (1.0 if divisors is None else divisors[i])
            x1, x2 = x[..., t, i].double(), x[..., t, i + D // 2].double()
            out[..., t, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[..., t, i + D // 2] = x1 * math.sin(a) + x2 * math.cos(a)
    return out


def test_rope_is_the_rotate_half_formula():
    rope = RotaryEmbedding(8)
    x = randn(2, 3, 5, 8, seed=7)
    positions = [0, 1, 5, 100, 4095]
    got = rope.rotate(x, torch.tensor(positions))
    assert got.dtype == torch.float64 and got.shape == x.shape
    torch.testing.assert_close(got, rope_fp64(x, positions), atol=1e-6, rtol=0)
    # position 0 is the identity
    torch.testing.assert_close(got[..., 0, :], x[..., 0, :], atol=0, rtol=0)


def test_scaled_rope_divides_each_frequency():
    divisors = [1.0, 2.5, 8.0, 31.0]
    rope = RotaryEmbedding(8, base=500.0, factors=divisors)
    x = randn(1, 2, 4, 8, seed=3)
    positions = [0, 7, 300, 4000]
    torch.testing.assert_close(
        rope.rotate(x, torch.tensor(positions)),
        rope_fp64(x, positions, base=500.0, divisors=divisors),
        atol=1e-6,
        rtol=0,
    )
    assert "factors=1.0..31.0" in repr(rope)  # what a compiled step's key reads
    assert repr(RotaryEmbedding(8, factors=[2.0] * 4)).endswith("factors=2.0)")


def test_rope_preserves_norms():
    rope = RotaryEmbedding(16)
    x = randn(2, 4, 9, 16, seed=8)
    y = rope.rotate(x, torch.arange(3, 12))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-6, rtol=0)
    # every (i, i + D/2) pair keeps its own length: it is a rotation, not just a norm-preserver
    pair = lambda t: t[..., :8] ** 2 + t[..., 8:] ** 2  # noqa: E731
    torch.testing.assert_close(pair(y), pair(x), atol=1e-5, rtol=0)
    assert not torch.allclose(y, x, atol=1e-2)


@pytest.mark.parametrize(("i", "j", "s"), [(0, 0, 7), (5, 2, 11), (2, 9, 30), (40, 3, 1000)])
def test_rope_scores_depend_only_on_relative_distance(i, j, s):
    rope = RotaryEmbedding(32)
    q, k = randn(1, 1, 1, 32, seed=9), randn(1, 1, 1, 32, seed=10)

    def score(a: int, b: int) -> float:
        qa = rope.rotate(q, torch.tensor([a]))
        kb = rope.rotate(k, torch.tensor([b]))
        return (qa * kb).sum().item()

    # cos/sin tables are float32, so fp64 inputs agree to about 1e-7 relative
    assert score(i + s, j + s) == pytest.approx(score(i, j), abs=1e-5)
    # while a different distance gives a different score
    assert abs(score(i, j + 1) - score(i, j)) > 1e-3


def test_rope_offset_matches_full_sequence_rotation():
    """Cached decoding rotates only the new tokens, at their absolute positions."""
    rope = RotaryEmbedding(8)
    x = randn(2, 3, 10, 8, seed=11)
    full = rope.rotate(x, resolve_positions(10))
    tail = rope.rotate(x[:, :, 6:], resolve_positions(4, offset=6))
    torch.testing.assert_close(tail, full[:, :, 6:], atol=0, rtol=0)
    one = rope.rotate(x[:, :, 9:], resolve_positions(1, positions=torch.tensor([9])))
    torch.testing.assert_close(one, full[:, :, 9:], atol=0, rtol=0)


def test_rope_per_row_positions():
    rope = RotaryEmbedding(8)
    x = randn(2, 3, 4, 8, seed=12)
    pos = torch.tensor([[0, 1, 2, 3], [5, 9, 2, 40]])  # (B, T): e.g. left padding per row
    got = rope.rotate(x, pos)
    for b in range(2):
        torch.testing.assert_close(got[b], rope_fp64(x[b], pos[b].tolist()), atol=1e-6, rtol=0)
    # a layer with RoPE: row b with positions pos[b] equals that row run alone
    torch.manual_seed(5)
    layer = MultiHeadAttention(16, 2, rope=RotaryEmbedding(8)).double()
    h = randn(2, 4, 16, seed=13)
    with torch.no_grad():
        together = layer(h, positions=pos)
        for b in range(2):
            alone = layer(h[b : b + 1], positions=pos[b])
            torch.testing.assert_close(together[b : b + 1], alone, atol=1e-12, rtol=0)
        # and the positions matter: row 1 with row 0's positions differs
        assert not torch.allclose(together[1:], layer(h[1:], positions=pos[0]), atol=1e-3)


def test_rope_rejects_odd_or_mismatched_head_dim():
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="head_dim 8, got x of shape"):
        RotaryEmbedding(8).rotate(torch.zeros(1, 1, 2, 6), torch.arange(2))
    with pytest.raises(ValueError, match="rope was built for head_dim 8, attention has 4"):
        MultiHeadAttention(16, 4, rope=RotaryEmbedding(8))


def test_rope_inside_attention_matches_manual_scores():
    """The layer rotates q and k after projection, per head, before softmax(q·k/√D)."""
    torch.manual_seed(6)
    C, H, D, T = 16, 2, 8, 5
    layer = MultiHeadAttention(C, H, rope=RotaryEmbedding(D)).double()
    x = randn(1, T, C, seed=14)
    with torch.no_grad():
        _, w = layer(x, offset=3, return_weights=True)
        q = (x @ layer.q_proj.weight.T + layer.q_proj.bias).view(1, T, H, D).transpose(1, 2)
        k = (x @ layer.k_proj.weight.T + layer.k_proj.bias).view(1, T, H, D).transpose(1, 2)
    positions = list(range(3, 3 + T))
    qr, kr = rope_fp64(q, positions), rope_fp64(k, positions)
    expected = torch.softmax(qr @ kr.transpose(-2, -1) / math.sqrt(D), dim=-1)
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)


# --- ALiBi ----------------------------------------------------------------------------------------


def test_alibi_slopes_power_of_two():
    expected = [2 ** (-8 * (i + 1) / 8) for i in range(8)]  # 2^-1 … 2^-8
    assert alibi_slopes(8).tolist() == pytest.approx(expected, rel=1e-7)
    expected4 = [2 ** (-8 * (i + 1) / 4) for i in range(4)]  # 2^-2, 2^-4, 2^-6, 2^-8
    assert alibi_slopes(4).tolist() == pytest.approx(expected4, rel=1e-7)


def test_alibi_slopes_not_a_power_of_two():
    """12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (4 of them)."""
    of8 = [2 ** (-8 * (i + 1) / 8) for i in range(8)]
    of16 = [2 ** (-8 * (i + 1) / 16) for i in range(16)]
    expected = [*of8, of16[0], of16[2], of16[4], of16[6]]
    assert alibi_slopes(12).tolist() == pytest.approx(expected, rel=1e-6)
    assert len(set(alibi_slopes(12).tolist())) == 12  # no two heads share a slope
    with pytest.raises(ValueError, match="n_heads must be a positive int, got 0"):
        alibi_slopes(0)


@pytest.mark.parametrize("symmetric", [False, True])
def test_alibi_bias_is_minus_slope_times_distance(symmetric):
    H, T, S = 4, 5, 7
    alibi = ALiBi(H, symmetric=symmetric)
    qpos, kpos = torch.arange(2, 2 + T), torch.arange(S)
    bias = alibi.bias(qpos, kpos)
    assert bias.shape == (1, H, T, S)
    for h in range(H):
        slope = 2 ** (-8 * (h + 1) / H)
        for t in range(T):
            for s in range(S):
                i, j = int(qpos[t]), s
                distance = abs(i - j) if symmetric else i - j
                assert bias[0, h, t, s].item() == pytest.approx(-slope * distance, abs=1e-6)
    per_row = alibi.bias(torch.stack([qpos, qpos + 1]), torch.stack([kpos, kpos]))
    assert per_row.shape == (2, H, T, S)
    torch.testing.assert_close(per_row[0], bias[0], atol=0, rtol=0)
    assert not torch.allclose(per_row[1], bias[0])


def test_alibi_inside_attention_matches_manual_scores():
    torch.manual_seed(7)
    C, H, D, T = 16, 4, 4, 6
    layer = MultiHeadAttention(C, H, alibi=ALiBi(H)).double()
    x = randn(1, T, C, seed=15)
    with torch.no_grad():
        _, w = layer(x, mask=masks.causal(), return_weights=True)
        q = (x @ layer.q_proj.weight.T + layer.q_proj.bias).view(1, T, H, D).transpose(1, 2)
        k = (x @ layer.k_proj.weight.T + layer.k_proj.bias).view(1, T, H, D).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    for h in range(H):
        slope = 2 ** (-8 * (h + 1) / H)
        for i in range(T):
            for j in range(T):
                scores[0, h, i, j] += -slope * (i - j) if j <= i else -math.inf
    expected = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="alibi was built for 8 heads, attention has 4"):
        MultiHeadAttention(C, H, alibi=ALiBi(8))


def test_rope_frequencies_survive_a_cast_to_bf16():
    """Casting a model to bf16 must not round RoPE's frequencies (only x is bf16)."""
    mha = MultiHeadAttention(32, 2, rope=RotaryEmbedding(16)).to(torch.bfloat16)
    assert mha.rope.inv_freq.dtype == torch.float64
    x = torch.randn(1, 2, 3, 16, dtype=torch.float64)  # (B, H, T, D)
    pos = torch.tensor([1000, 2000, 3000])
    exact = mha.rope.rotate(x, pos)
    low = mha.rope.rotate(x.to(torch.bfloat16), pos).double()
    # only x's own rounding (bf16 ≈ 3 significant digits), not a rounded angle at position 3000
    assert (low - exact).abs().max() < 0.05 * x.abs().max()


def test_valid_positions_count_each_rows_real_tokens_from_zero():
    valid = torch.tensor([[False, False, True, True], [True, True, True, False]])
    assert valid_positions(valid).tolist() == [[0, 0, 0, 1], [0, 1, 2, 2]]
    for bad in (valid.long(), valid[0], [[True]]):
        with pytest.raises(TypeError, match="valid must be a"):
            valid_positions(bad)
