"""LayerNorm, MLP and the Transformer block (§9, §10).

Notation: ``B`` batch, ``H`` heads, ``T`` length, ``S`` context length, ``C`` model width.

LayerNorm and the MLP are checked against their formulas written out in float64; the block
against a hand-written composition of its own sub-modules, following block.py's docstring.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat import MLP, Block, BlockConfig, LayerNorm, masks
from dikkat.layers import PRESETS, BlockWeights


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Give every parameter random values (LayerNorm starts at weight 1, bias 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return module


# --- LayerNorm ------------------------------------------------------------------------------------


def layer_norm_fp64(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """(x − mean) / √(var + eps) · weight + bias, var the biased (1/C) variance."""
    x = x.double()
    C = x.shape[-1]
    mean = x.sum(-1, keepdim=True) / C
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / C
    y = (x - mean) / torch.sqrt(var + eps) * weight.double()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("eps", [1e-5, 1e-12, 0.5])
def test_layer_norm_matches_formula_and_torch(eps):
    ln = randomize(LayerNorm(10, eps=eps), seed=1)
    ref = nn.LayerNorm(10, eps=eps)
    ref.load_state_dict(ln.state_dict())
    x = randn(3, 4, 10, seed=2, dtype=torch.float32) * 3 + 1
    torch.testing.assert_close(ln(x), ref(x), atol=1e-6, rtol=0)
    expected = layer_norm_fp64(x, ln.weight, ln.bias, eps)
    torch.testing.assert_close(ln.double()(x.double()), expected, atol=1e-12, rtol=0)


def test_layer_norm_normalizes_before_the_affine():
    ln = LayerNorm(16)  # weight 1, bias 0: the plain normalisation
    x = randn(5, 16, seed=3) * 4 + 7
    y = ln.double()(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    biased_var = y.var(-1, unbiased=False)
    expected_var = x.var(-1, unbiased=False) / (x.var(-1, unbiased=False) + 1e-5)
    torch.testing.assert_close(biased_var, expected_var, atol=1e-12, rtol=0)


def test_layer_norm_without_bias():
    ln = randomize(LayerNorm(6, bias=False), seed=4).double()
    assert ln.bias is None
    assert [n for n, _ in ln.named_parameters()] == ["weight"]
    x = randn(2, 6, seed=5)
    torch.testing.assert_close(ln(x), layer_norm_fp64(x, ln.weight, None, 1e-5), atol=1e-12, rtol=0)
    ref = nn.LayerNorm(6, bias=False).double()
    ref.weight.data.copy_(ln.weight.data)
    torch.testing.assert_close(ln(x), ref(x), atol=1e-12, rtol=0)


def test_layer_norm_rejects_wrong_width():
    with pytest.raises(ValueError, match=r"last dim of 8, got x of shape \(2, 3, 7\)"):
        LayerNorm(8)(torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match="d_model must be a positive int, got 0"):
        LayerNorm(0)


# --- MLP ------------------------------------------------------------------------------------------


def gelu_erf(u: Tensor) -> Tensor:
    return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))


def gelu_tanh(u: Tensor) -> Tensor:
    return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


ACTIVATIONS = {
    "gelu": (gelu_erf, F.gelu),
    "gelu_tanh": (gelu_tanh, lambda u: F.gelu(u, approximate="tanh")),
    "relu": (lambda u: torch.where(u > 0, u, torch.zeros_like(u)), F.relu),
}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_mlp_is_down_act_up_by_hand(activation):
    torch.manual_seed(6)
    mlp = MLP(8, activation=activation).double()
    x = randn(2, 3, 8, seed=7) * 2
    W1, b1 = mlp.up.weight, mlp.up.bias
    W2, b2 = mlp.down.weight, mlp.down.bias
    by_hand, by_torch = ACTIVATIONS[activation]
    with torch.no_grad():
        y = mlp(x)
        u = x @ W1.T + b1  # (B, T, 4C)
        torch.testing.assert_close(y, by_hand(u) @ W2.T + b2, atol=1e-12, rtol=0)
        torch.testing.assert_close(y, by_torch(u) @ W2.T + b2, atol=1e-12, rtol=0)


def test_mlp_activations_differ():
    """The three choices are really different functions on the same weights."""
    outs = {}
    for activation in ACTIVATIONS:
        torch.manual_seed(8)
        outs[activation] = MLP(8, activation=activation).double()(randn(4, 8, seed=9) * 2)
    assert not torch.allclose(outs["gelu"], outs["gelu_tanh"], atol=1e-6)
    assert not torch.allclose(outs["gelu"], outs["relu"], atol=1e-3)


def test_mlp_widths_and_bias():
    mlp = MLP(12)
    assert (mlp.up.in_features, mlp.up.out_features) == (12, 48)  # hidden 4·d
    assert (mlp.down.in_features, mlp.down.out_features) == (48, 12)
    assert MLP(12, 20).up.out_features == 20
    no_bias = MLP(12, bias=False)
    assert no_bias.up.bias is None and no_bias.down.bias is None


def test_mlp_rejects_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be one of .*got 'swish'"):
        MLP(8, activation="swish")


# --- Block ----------------------------------------------------------------------------------------


def by_hand(block: Block, x: Tensor, mask=None, context=None, context_mask=None) -> Tensor:
    """block.py's docstring formulas, written with the block's own sub-modules (eval mode)."""

    def attn(h: Tensor) -> Tensor:
        return block.attn(h, mask=mask)

    def cross(h: Tensor) -> Tensor:
        return block.cross_attn(h, context, context_mask)

    if block.config.norm == "pre":
        x = x + attn(block.norm1(x))
        if context is not None:
            x = x + cross(block.norm_cross(x))
        return x + block.mlp(block.norm2(x))
    x = block.norm1(x + attn(x))
    if context is not None:
        x = block.norm_cross(x + cross(x))
    return block.norm2(x + block.mlp(x))


def make_block(seed: int, **config) -> Block:
    torch.manual_seed(seed)
    block = Block(BlockConfig(d_model=16, n_heads=4, dropout=0.1, **config)).double()
    return randomize(block, seed).eval()


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_block_is_its_formula(norm, mask):
    block = make_block(10, norm=norm)
    x = randn(2, 5, 16, seed=11)
    m = masks.causal() if mask else None
    with torch.no_grad():
        torch.testing.assert_close(block(x, m), by_hand(block, x, m), atol=1e-12, rtol=0)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_block_split_around_its_attention_is_the_block(norm):
    """attention_input, then the attention, then after_attention: what a static decode step
    runs, the block's own output."""
    block = make_block(15, norm=norm)
    x = randn(2, 5, 16, seed=16)
    m = masks.causal()
    with torch.no_grad():
        a = block.attn(block.attention_input(x), None, m)
        torch.testing.assert_close(block.after_attention(x, a), block(x, m), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="without cross-attention"):
        make_block(15, cross_attention=True).after_attention(x, a)


def test_pre_and_post_norm_really_differ():
    pre, post = make_block(12, norm="pre"), make_block(12, norm="post")
    post.load_state_dict(pre.state_dict())  # same weights, only the norm placement differs
    x = randn(2, 5, 16, seed=13)
    with torch.no_grad():
        assert not torch.allclose(pre(x), post(x), atol=1e-3)
        # post-norm ends in LayerNorm: (out − norm2.bias) / norm2.weight has mean 0 per token
        z = (post(x) - post.norm2.bias) / post.norm2.weight
    torch.testing.assert_close(
        z.mean(-1), torch.zeros(2, 5, dtype=torch.float64), atol=1e-10, rtol=0
    )


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_block_with_cross_attention_is_its_formula(norm):
    block = make_block(14, norm=norm, cross_attention=True)
    B, T, S = 2, 4, 6
    x, ctx = randn(B, T, 16, seed=15), randn(B, S, 16, seed=16)
    cmask = masks.padding(torch.tensor([6, 3]))
    with torch.no_grad():
        y = block(x, masks.causal(), context=ctx, context_mask=cmask)
        expected = by_hand(block, x, masks.causal(), ctx, cmask)
        torch.testing.assert_close(y, expected, atol=1e-12, rtol=0)
        # the context's content matters; its order does not (keys and values are a set, §8)
        y_full = block(x, context=ctx)
        assert not torch.allclose(block(x, context=randn(B, S, 16, seed=99)), y_full, atol=1e-3)
        torch.testing.assert_close(block(x, context=ctx.flip(1)), y_full, atol=1e-12, rtol=0)
        # and its padded positions do not matter at all
        ctx2 = ctx.clone()
        ctx2[1, 3:] = 50.0
        y2 = block(x, masks.causal(), context=ctx2, context_mask=cmask)
    torch.testing.assert_close(y2, y, atol=1e-12, rtol=0)


def test_block_return_weights():
    block = make_block(17, cross_attention=True)
    B, T, S = 2, 5, 3
    x, ctx = randn(B, T, 16, seed=18), randn(B, S, 16, seed=19)
    with torch.no_grad():
        y, w = block(x, masks.causal(), context=ctx, return_weights=True)
        y_plain = block(x, masks.causal(), context=ctx)
    assert isinstance(w, BlockWeights)
    assert w.self_attn.shape == (B, 4, T, T)
    assert w.cross_attn.shape == (B, 4, T, S)
    torch.testing.assert_close(y, y_plain, atol=1e-12, rtol=0)
    assert torch.equal(w.self_attn.triu(diagonal=1), torch.zeros(B, 4, T, T, dtype=torch.float64))
    ones = torch.ones(B, 4, T, dtype=torch.float64)
    torch.testing.assert_close(w.self_attn.sum(-1), ones)
    torch.testing.assert_close(w.cross_attn.sum(-1), ones)
    # the self-attention weights are those of attn on norm1(x) (pre-norm)
    with torch.no_grad():
        _, w_direct = block.attn(block.norm1(x), mask=masks.causal(), return_weights=True)
    torch.testing.assert_close(w.self_attn, w_direct, atol=1e-12, rtol=0)

    plain = make_block(20)
    with torch.no_grad():
        _, w2 = plain(x, return_weights=True)
    assert w2.self_attn.shape == (B, 4, T, T) and w2.cross_attn is None


def test_block_context_must_match_cross_attention():
    with pytest.raises(ValueError, match="needs a context"):
        make_block(21, cross_attention=True)(randn(1, 3, 16))
    with pytest.raises(ValueError, match="has no cross-attention and takes no context"):
        make_block(22)(randn(1, 3, 16), context=randn(1, 2, 16))


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_causal_block_ignores_later_tokens(norm):
    block = make_block(23, norm=norm)
    x = randn(1, 7, 16, seed=24)
    t = 4
    x2 = x.clone()
    x2[:, t + 1 :] = randn(1, 2, 16, seed=25) * 10  # change every token after t
    with torch.no_grad():
        y, y2 = block(x, masks.causal()), block(x2, masks.causal())
        torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], atol=1e-12, rtol=0)
        assert not torch.allclose(y2[:, t + 1 :], y[:, t + 1 :], atol=1e-3)
        # without the mask the earlier outputs do see the change
        assert not torch.allclose(block(x2)[:, : t + 1], block(x)[:, : t + 1], atol=1e-3)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_block_residual_dropout_only_in_training(norm):
    block = make_block(26, norm=norm)
    block.attn.dropout = 0.0  # leave only the dropout on the residual branches
    x = randn(1, 4, 16, seed=27)
    with torch.no_grad():
        y = block(x)
        torch.testing.assert_close(block(x), y, atol=0, rtol=0)  # eval: deterministic
        block.train()
        torch.manual_seed(0)
        assert not torch.allclose(block(x), y, atol=1e-3)


def test_block_gradients_reach_every_parameter():
    torch.manual_seed(28)
    block = Block(BlockConfig(d_model=16, n_heads=4, n_kv_heads=2, cross_attention=True))
    x = torch.randn(2, 5, 16, requires_grad=True)
    ctx = torch.randn(2, 3, 16, requires_grad=True)
    out = block(x, masks.causal(), context=ctx)
    out.square().mean().backward()
    params = dict(block.named_parameters())
    # 2 attentions × 2 linears (fused q/k/v, output), 3 norms, MLP; the state dict names 4 linears
    assert len(params) == 2 * 2 * 2 + 3 * 2 + 2 * 2
    assert len(block.state_dict()) == 4 * 2 * 2 + 3 * 2 + 2 * 2
    for name, p in params.items():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    for t in (x, ctx):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    # the bulk of every weight matrix gets signal, each of q, k and v on its own (key biases
    # alone may be ~0: softmax is invariant to adding the same score to a whole row)
    for attn in (block.attn, block.cross_attn):
        for block_grad in attn.qkv_proj.weight.grad.split(attn.qkv_sizes):
            assert block_grad.abs().sum() > 0
    for name, p in params.items():
        if name.endswith("weight"):
            assert p.grad.abs().sum() > 0, name


# --- BlockConfig ----------------------------------------------------------------------------------


def test_original_base_preset_is_the_seed_numbers():
    """§9: "the first Transformer used 8 heads of 64 in a 512-dimensional model"."""
    c = BlockConfig.preset("original-base")
    assert (c.d_model, c.n_heads, c.head_dim, c.hidden) == (512, 8, 64, 2048)
    assert c.n_heads * c.head_dim == c.d_model
    assert c.hidden == 4 * c.d_model
    assert c.norm == "post" and c.activation == "relu"
    block = Block(c)
    assert block.attn.q_proj.weight.shape == (512, 512)
    assert block.mlp.up.weight.shape == (2048, 512)


def test_presets_build_and_overrides_copy():
    for name, c in PRESETS.items():
        assert BlockConfig.preset(name) == c
        assert c.head_dim * c.n_heads == c.d_model
    pre = BlockConfig.preset("original-base", norm="pre", dropout=0.0)
    assert pre.norm == "pre" and pre.dropout == 0.0 and pre.d_model == 512
    assert PRESETS["original-base"].norm == "post"  # the preset itself is unchanged


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown block preset 'gpt5'; choose one of"):
        BlockConfig.preset("gpt5")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 30, "n_heads": 4}, "d_model=30 is not divisible by n_heads=4"),
        ({"n_heads": 8, "n_kv_heads": 3}, "n_kv_heads=3 must be positive and divide n_heads=8"),
        ({"n_kv_heads": 0}, "n_kv_heads=0"),
        ({"norm": "middle"}, "norm must be 'pre' or 'post', got 'middle'"),
        ({"d_model": 0}, "d_model must be a positive int, got 0"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockConfig(**kwargs)


def test_config_is_frozen():
    c = BlockConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 64
    assert c.d_model == 512


def test_config_fields_reach_the_modules():
    c = BlockConfig(
        d_model=24, n_heads=6, n_kv_heads=2, d_ff=40, norm_eps=1e-3, activation="relu", bias=False
    )
    block = Block(c)
    assert block.attn.n_heads == 6 and block.attn.n_kv_heads == 2
    assert block.attn.k_proj.out_features == 2 * 4  # G · D
    assert block.attn.q_proj.bias is None and block.norm1.bias is None
    assert block.mlp.up.out_features == 40 and isinstance(block.mlp.act, nn.ReLU)
    assert block.norm1.eps == block.norm2.eps == 1e-3
    assert block.cross_attn is None and block.norm_cross is None
