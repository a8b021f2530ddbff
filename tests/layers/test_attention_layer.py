"""MultiHeadAttention: torch parity (§13), GQA (§17), cross-attention (§14), every backend.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` head dim, ``C`` model width, ``Cc`` context width.

The oracle is :func:`manual_mha`, the multi-head formula written head by head in float64 from the
layer's own weights; torch's ``nn.MultiheadAttention`` is the second, external oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import dikkat
from dikkat import MultiHeadAttention, masks


def manual_mha(
    layer: MultiHeadAttention,
    x: Tensor,
    context: Tensor | None = None,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q_h k_hᵀ/√D) v_h per head, concatenated, times W_O; float64, one head at a time.

    ``allowed`` is a bool tensor broadcastable to (B, H, T, S), True = may attend.
    Query head h reads key/value head h // (H / G).
    """
    x = x.double()
    src = x if context is None else context.double()
    H, G, D = layer.n_heads, layer.n_kv_heads, layer.head_dim

    def linear(lin: nn.Linear, t: Tensor) -> Tensor:
        y = t @ lin.weight.double().T
        return y if lin.bias is None else y + lin.bias.double()

    q, k, v = linear(layer.q_proj, x), linear(layer.k_proj, src), linear(layer.v_proj, src)
    B, T, S = x.shape[0], x.shape[1], src.shape[1]
    if allowed is not None:
        allowed = allowed.expand(B, H, T, S)
    heads, weights = [], []
    for h in range(H):
        g = h // (H // G)
        qh = q[:, :, h * D : (h + 1) * D]  # (B, T, D)
        kh = k[:, :, g * D : (g + 1) * D]  # (B, S, D)
        vh = v[:, :, g * D : (g + 1) * D]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(D)  # (B, T, S)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, h], float("-inf"))
        w = torch.softmax(scores, dim=-1)
        heads.append(w @ vh)
        weights.append(w)
    y = linear(layer.out_proj, torch.cat(heads, dim=-1))
    return y, torch.stack(weights, dim=1)  # (B, T, C), (B, H, T, S)


def randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def torch_mha(E: int, H: int, *, bias: bool = True, kdim: int | None = None, seed: int = 0):
    """torch's MHA with random biases (torch initialises them to 0, which would hide a mix-up)."""
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=kdim, batch_first=True).eval()
    if bias:
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m


def random_blocked(*shape: int, seed: int) -> Tensor:
    """A random torch-style bool mask (True = blocked) that never blocks the diagonal or key 0.

    So no row is ever fully blocked, even combined with padding at the end (torch gives NaN there).
    """
    blocked = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < 0.4
    blocked &= ~torch.eye(shape[-2], shape[-1], dtype=torch.bool)
    blocked[..., 0] = False
    return blocked


# --- torch parity (from_torch) --------------------------------------------------------------------

SIZES = [(16, 2, 5), (24, 3, 7), (32, 8, 4), (12, 1, 6)]  # (E, H, T)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("E", "H", "T"), SIZES)
def test_from_torch_matches_outputs_and_weights(E, H, T, bias):
    m = torch_mha(E, H, bias=bias, seed=E + H)
    ours = MultiHeadAttention.from_torch(m).eval()
    x = randn(2, T, E, seed=T)
    with torch.no_grad():
        ref_out, ref_w = m(x, x, x, need_weights=True, average_attn_weights=True)
        _, ref_w_heads = m(x, x, x, need_weights=True, average_attn_weights=False)
        out, w = ours(x, return_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    assert w.shape == (2, H, T, T)
    torch.testing.assert_close(w.mean(1), ref_w, atol=1e-6, rtol=0)
    torch.testing.assert_close(w, ref_w_heads, atol=1e-6, rtol=0)
    assert (ours.q_proj.bias is None) == (not bias)


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_cross_attention_with_separate_kdim(bias):
    E, H, Cc, T, S = 16, 4, 10, 3, 7
    m = torch_mha(E, H, bias=bias, kdim=Cc, seed=3)
    assert m.in_proj_weight is None  # torch keeps separate q/k/v weights in this case
    ours = MultiHeadAttention.from_torch(m).eval()
    assert ours.context_dim == Cc
    x, ctx = randn(2, T, E, seed=1), randn(2, S, Cc, seed=2)
    with torch.no_grad():
        ref_out, ref_w = m(x, ctx, ctx)
        out, w = ours(x, ctx, return_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.mean(1), ref_w, atol=1e-6, rtol=0)


def _torch_masks(B: int, H: int, T: int) -> dict[str, dict]:
    """torch MHA mask keyword sets (True = blocked), keyed by a readable name."""
    blocked = random_blocked(T, T, seed=5)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, T - 2 :] = True  # the last two keys of sequence 0 are padding
    per_head = random_blocked(B * H, T, T, seed=6)
    return {
        "bool": {"attn_mask": blocked},
        "float": {"attn_mask": torch.zeros(T, T).masked_fill(blocked, float("-inf"))},
        "causal": {"attn_mask": torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)},
        "key_padding": {"key_padding_mask": padding},
        "bool+key_padding": {"attn_mask": blocked, "key_padding_mask": padding},
        "per_head": {"attn_mask": per_head},
    }


@pytest.mark.parametrize("kind", list(_torch_masks(2, 4, 6)))
def test_from_torch_with_converted_masks(kind):
    B, E, H, T = 2, 16, 4, 6
    kwargs = _torch_masks(B, H, T)[kind]
    m = torch_mha(E, H, seed=11)
    ours = MultiHeadAttention.from_torch(m).eval()
    x = randn(B, T, E, seed=12)
    mask = masks.from_torch_mask(**kwargs, n_heads=H)
    with torch.no_grad():
        ref_out, ref_w = m(x, x, x, average_attn_weights=False, **kwargs)
        out, w = ours(x, mask=mask, return_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.mean(1), ref_w.mean(1), atol=1e-6, rtol=0)
    # the mask did something: some weights are exactly 0, none where torch allowed attention
    assert (w == 0).any()
    assert torch.equal(w == 0, ref_w == 0)


def test_from_torch_accepts_batch_second_modules_on_transposed_input():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, batch_first=False).eval()
    ours = MultiHeadAttention.from_torch(m).eval()
    x = randn(5, 3, 16)  # (T, B, C), torch's default layout
    with torch.no_grad():
        ref, _ = m(x, x, x)
        out = ours(x.transpose(0, 1))  # ours is batch-first
    torch.testing.assert_close(out.transpose(0, 1), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kwargs", [{"add_bias_kv": True}, {"add_zero_attn": True}], ids=["add_bias_kv", "add_zero_attn"]
)
def test_from_torch_rejects_what_has_no_equivalent(kwargs):
    m = nn.MultiheadAttention(16, 2, batch_first=True, **kwargs)
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn"):
        MultiHeadAttention.from_torch(m)


def test_from_torch_rejects_different_kdim_and_vdim():
    m = nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True)
    with pytest.raises(ValueError, match="kdim=8 and vdim=12"):
        MultiHeadAttention.from_torch(m)


def test_from_torch_rejects_other_modules():
    with pytest.raises(TypeError, match="Linear"):
        MultiHeadAttention.from_torch(nn.Linear(16, 16))


# --- the PyTorch example of docs/contract.md §13, run against our layer ---------------------------


def test_seed_s13_script_against_ours():
    torch.manual_seed(0)
    tokens = torch.randn(1, 5, 16)
    attn = torch.nn.MultiheadAttention(embed_dim=16, num_heads=2, batch_first=True)
    ours = MultiHeadAttention.from_torch(attn)

    # "Attention weights shape: (1, 5, 5)" — torch averages the heads; ours returns them all.
    with torch.no_grad():
        out, weights = ours(tokens, return_weights=True)
        _, torch_weights = attn(tokens, tokens, tokens)
    assert weights.shape == (1, 2, 5, 5)
    assert tuple(weights.mean(1).shape) == tuple(torch_weights.shape) == (1, 5, 5)

    # "Same outputs after shuffling: True"
    perm = torch.tensor([3, 0, 4, 1, 2])
    with torch.no_grad():
        out_shuffled = ours(tokens[:, perm])
    assert torch.allclose(out_shuffled, out[:, perm], atol=1e-6)

    # The causal mask: torch's True = blocked, converted to ours (True = may attend).
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        _, causal_w = ours(tokens, mask=masks.from_torch_mask(mask), return_weights=True)
        _, torch_causal_w = attn(tokens, tokens, tokens, attn_mask=mask)
    causal_w = causal_w.mean(1)  # (1, 5, 5), as torch prints it
    torch.testing.assert_close(causal_w, torch_causal_w, atol=1e-6, rtol=0)
    assert torch.equal(causal_w[0].triu(diagonal=1), torch.zeros(5, 5))  # exactly 0 above
    assert torch.equal(causal_w[0], causal_w[0].tril())  # lower-triangular
    assert causal_w[0, 0, 0].item() == 1.0  # the first token gives itself all the weight
    torch.testing.assert_close(causal_w.sum(-1), torch.ones(1, 5))
    # The seed prints row 1 as "0.31 0.69" (seed 003, after the MultiheadAttention script): the
    # seed's own claim, reproduced for torch and for ours.
    for w in (causal_w, torch_causal_w):
        assert [round(float(p), 2) for p in w[0, 1, :2]] == [0.31, 0.69]


# --- grouped-query attention (§17) ----------------------------------------------------------------


def _expanded_kv(gqa: MultiHeadAttention) -> MultiHeadAttention:
    """A plain multi-head layer (G = H) whose head h uses GQA key/value head h // (H / G)."""
    H, G, D = gqa.n_heads, gqa.n_kv_heads, gqa.head_dim
    plain = MultiHeadAttention(gqa.d_model, H)
    with torch.no_grad():
        for src, dst in ((gqa.q_proj, plain.q_proj), (gqa.out_proj, plain.out_proj)):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
        for src, dst in ((gqa.k_proj, plain.k_proj), (gqa.v_proj, plain.v_proj)):
            for h in range(H):
                g = h // (H // G)
                dst.weight[h * D : (h + 1) * D] = src.weight[g * D : (g + 1) * D]
                dst.bias[h * D : (h + 1) * D] = src.bias[g * D : (g + 1) * D]
    return plain


@pytest.mark.parametrize(("H", "G"), [(8, 2), (8, 1), (6, 3), (4, 4)])
def test_gqa_equals_mha_with_repeated_kv_weights(H, G):
    torch.manual_seed(H * 10 + G)
    C, T = 32 if H != 6 else 24, 7
    gqa = MultiHeadAttention(C, H, n_kv_heads=G)
    plain = _expanded_kv(gqa)
    D = C // H
    assert gqa.k_proj.out_features == gqa.v_proj.out_features == G * D
    # the keys and values a cache would hold shrink by H / G
    assert plain.k_proj.out_features // gqa.k_proj.out_features == H // G
    x = randn(2, T, C, seed=4)
    with torch.no_grad():
        for mask in (None, masks.causal()):
            out, w = gqa(x, mask=mask, return_weights=True)
            ref, ref_w = plain(x, mask=mask, return_weights=True)
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
            torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
            manual, manual_w = manual_mha(gqa, x, allowed=None if mask is None else _tril(T))
            torch.testing.assert_close(out.double(), manual, atol=1e-5, rtol=0)
            torch.testing.assert_close(w.double(), manual_w, atol=1e-6, rtol=0)


def _tril(T: int, S: int | None = None) -> Tensor:
    return torch.ones(T, T if S is None else S, dtype=torch.bool).tril()


@pytest.mark.parametrize("G", [3, 5, 0, -2])
def test_gqa_rejects_kv_heads_not_dividing(G):
    with pytest.raises(ValueError, match=f"n_kv_heads={G}.*n_heads=8"):
        MultiHeadAttention(32, 8, n_kv_heads=G)


def test_head_dim_must_divide_or_be_given():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        MultiHeadAttention(30, 4)
    layer = MultiHeadAttention(30, 4, head_dim=8)  # an explicit head_dim lifts the rule
    assert layer.q_proj.out_features == 32 and layer.out_proj.out_features == 30
    x = randn(1, 3, 30)
    with torch.no_grad():
        out, w = layer(x, return_weights=True)
    manual, manual_w = manual_mha(layer, x)
    torch.testing.assert_close(out.double(), manual, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.double(), manual_w, atol=1e-6, rtol=0)


# --- the layer against the plain formula, fp64 ---------------------------------------------------


@pytest.mark.parametrize("mask", [None, "causal", "padding"])
def test_self_attention_matches_manual_fp64(mask):
    torch.manual_seed(21)
    B, C, H, T = 2, 24, 4, 6
    layer = MultiHeadAttention(C, H).double()
    x = randn(B, T, C, seed=22).double()
    lengths = torch.tensor([6, 3])
    ours_mask = {"causal": masks.causal(), "padding": masks.padding(lengths)}.get(mask)
    allowed = {
        "causal": _tril(T),
        "padding": (torch.arange(T) < lengths[:, None]).view(B, 1, 1, T),
    }.get(mask)
    with torch.no_grad():
        out, w = layer(x, mask=ours_mask, return_weights=True)
    manual, manual_w = manual_mha(layer, x, allowed=allowed)
    torch.testing.assert_close(out, manual, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, manual_w, atol=1e-12, rtol=0)


def test_dropout_is_off_in_eval():
    torch.manual_seed(2)
    layer = MultiHeadAttention(16, 2, dropout=0.5).double()
    x = randn(1, 5, 16).double()
    layer.eval()
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, manual_mha(layer, x)[0], atol=1e-12, rtol=0)
    layer.train()
    torch.manual_seed(3)
    with torch.no_grad():
        assert not torch.allclose(layer(x), out, atol=1e-3)


# --- cross-attention (§14) ------------------------------------------------------------------------


def test_cross_attention_shapes_and_manual_fp64():
    torch.manual_seed(31)
    B, T, S, C, Cc, H = 2, 3, 7, 16, 10, 4
    layer = MultiHeadAttention(C, H, context_dim=Cc).double()
    x, ctx = randn(B, T, C, seed=1).double(), randn(B, S, Cc, seed=2).double()
    with torch.no_grad():
        out, w = layer(x, ctx, return_weights=True)
    assert out.shape == (B, T, C)
    assert w.shape == (B, H, T, S)
    manual, manual_w = manual_mha(layer, x, ctx)
    torch.testing.assert_close(out, manual, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, manual_w, atol=1e-12, rtol=0)
    # queries come from x: changing the context changes the output, its shape stays (B, T, C)
    with torch.no_grad():
        other = layer(x, ctx.flip(1)[:, :4])
    assert other.shape == (B, T, C)


def test_cross_attention_gqa_matches_manual_fp64():
    torch.manual_seed(32)
    B, T, S, C, Cc, H, G = 2, 5, 3, 24, 12, 6, 2
    layer = MultiHeadAttention(C, H, n_kv_heads=G, context_dim=Cc).double()
    x, ctx = randn(B, T, C, seed=3).double(), randn(B, S, Cc, seed=4).double()
    with torch.no_grad():
        out, w = layer(x, ctx, return_weights=True)
    manual, manual_w = manual_mha(layer, x, ctx)
    torch.testing.assert_close(out, manual, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, manual_w, atol=1e-12, rtol=0)


def test_cross_attention_context_padding_zeroes_padded_keys():
    torch.manual_seed(33)
    B, T, S, C, Cc, H = 2, 4, 6, 16, 8, 2
    layer = MultiHeadAttention(C, H, context_dim=Cc).double()
    x, ctx = randn(B, T, C, seed=5).double(), randn(B, S, Cc, seed=6).double()
    lengths = torch.tensor([6, 2])
    with torch.no_grad():
        out, w = layer(x, ctx, masks.padding(lengths), return_weights=True)
        # the padded keys' contents cannot matter
        ctx2 = ctx.clone()
        ctx2[1, 2:] = 100.0
        out2 = layer(x, ctx2, masks.padding(lengths))
    assert torch.equal(w[1, :, :, 2:], torch.zeros(H, T, S - 2))
    assert (w[0] > 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T, dtype=torch.float64))
    torch.testing.assert_close(out2, out, atol=1e-12, rtol=0)
    allowed = (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S)
    manual, manual_w = manual_mha(layer, x, ctx, allowed)
    torch.testing.assert_close(out, manual, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, manual_w, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("x_shape", "ctx_shape", "match"),
    [
        ((2, 3, 12), (2, 5, 8), r"x must have shape \(B, L, 16\), got \(2, 3, 12\)"),
        ((2, 3, 16), (2, 5, 16), r"context must have shape \(B, L, 8\), got \(2, 5, 16\)"),
        ((3, 16), (2, 5, 8), r"x must have shape \(B, L, 16\), got \(3, 16\)"),
        ((2, 3, 16), (5, 8), r"context must have shape \(B, L, 8\), got \(5, 8\)"),
        (
            (2, 3, 16),
            (3, 5, 8),
            r"context batch 3 differs from x batch 2: x \(2, 3, 16\), context \(3, 5, 8\)",
        ),
    ],
)
def test_cross_attention_bad_shapes(x_shape, ctx_shape, match):
    layer = MultiHeadAttention(16, 2, context_dim=8)
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(*x_shape), torch.randn(*ctx_shape))


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="x must be a tensor"):
        MultiHeadAttention(16, 2)([[0.0] * 16])


# --- every backend gives the layer the same output ------------------------------------------------

BACKENDS = dikkat.available_backends(exact_only=True)


@pytest.mark.parametrize("case", ["plain", "causal", "padding", "gqa", "cross"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_gives_the_same_layer_output(backend, case):
    torch.manual_seed(41)
    B, T, S, C, H = 2, 6, 4, 32, 4
    layer = MultiHeadAttention(C, H, n_kv_heads=2 if case == "gqa" else None).eval()
    x, ctx = randn(B, T, C, seed=7), randn(B, S, C, seed=8)
    context = ctx if case == "cross" else None
    mask = {"causal": masks.causal(), "padding": masks.padding(torch.tensor([6, 4]))}.get(case)
    with torch.no_grad():
        layer.backend = "reference"
        expected = layer(x, context, mask)
        layer.backend = backend
        try:
            out = layer(x, context, mask)
        except ValueError as e:  # a backend may refuse (e.g. it needs a GPU); it must say so
            if "cannot serve this call" not in str(e):
                raise
            pytest.skip(str(e))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    # and the reference itself is the plain formula
    allowed = None
    if case == "causal":
        allowed = _tril(T)
    elif case == "padding":
        allowed = (torch.arange(T) < torch.tensor([6, 4])[:, None]).view(B, 1, 1, T)
    manual, _ = manual_mha(layer, x, context, allowed)
    torch.testing.assert_close(expected.double(), manual, atol=1e-5, rtol=0)
