"""MultiHeadAttention's fused q/k/v projection: one path, three names.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` query length, ``S`` key
length, ``D`` head dim, ``C`` model width, ``Cc`` context width.

The layer holds one ((H + 2G)·D, C) weight where the context has x's width; its state dict
holds ``q_proj``/``k_proj``/``v_proj`` as three separate Linears would. The oracle is
:func:`three_projections`: the layer's formula in float64 from three separate weight tensors.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from dikkat import MultiHeadAttention, masks
from dikkat.layers import Block, BlockConfig, KVCache
from dikkat.layers.linear import Linear, LinearRows

NAMES = ("q_proj", "k_proj", "v_proj", "out_proj")

# (C, H, G, Cc): self-attention, GQA, cross-attention of the same width (fused), of another width
CASES = {
    "self": (24, 4, None, None),
    "gqa": (24, 6, 2, None),
    "mqa": (16, 4, 1, None),
    "cross": (24, 4, None, None),
    "cross-gqa": (24, 6, 3, None),
    "cross-other-width": (24, 6, 2, 10),
}


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def layer_for(case: str, *, bias: bool = True, seed: int = 0) -> MultiHeadAttention:
    C, H, G, Cc = CASES[case]
    torch.manual_seed(seed)
    layer = MultiHeadAttention(C, H, n_kv_heads=G, context_dim=Cc, bias=bias).double()
    if bias:  # random biases: zeros would hide a block mix-up
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 1:
                    p.normal_()
    return layer


def inputs_for(case: str, layer: MultiHeadAttention, seed: int = 1) -> tuple[Tensor, Tensor | None]:
    x = randn(2, 5, layer.d_model, seed=seed)
    context = randn(2, 7, layer.context_dim, seed=seed + 1) if "cross" in case else None
    return x, context


def three_projections(
    w: dict[str, Tensor],
    x: Tensor,
    context: Tensor | None,
    H: int,
    G: int,
    causal: bool = False,
) -> Tensor:
    """softmax(q kᵀ/√D) v with q = x W_qᵀ + b_q, k = c W_kᵀ + b_k, v = c W_vᵀ + b_v from three
    separate weights (c = context, or x itself), query head h reading key/value head h // (H/G),
    heads concatenated, times W_O."""
    src = x if context is None else context

    def proj(name: str, t: Tensor) -> Tensor:
        return F.linear(t, w[f"{name}.weight"], w.get(f"{name}.bias"))

    B, T, S = x.shape[0], x.shape[1], src.shape[1]
    q = proj("q_proj", x).view(B, T, H, -1).transpose(1, 2)  # (B, H, T, D)
    k = proj("k_proj", src).view(B, S, G, -1).transpose(1, 2)  # (B, G, S, D)
    v = proj("v_proj", src).view(B, S, G, -1).transpose(1, 2)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, S, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if causal:
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), float("-inf"))
    heads = torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)
    return proj("out_proj", heads.transpose(1, 2).reshape(B, T, -1))


# --- the fused product is the three-projection formula, forward and backward ----------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_projection_equals_three_projections_fp64(case, bias):
    layer = layer_for(case, bias=bias, seed=len(case))
    x, context = inputs_for(case, layer)
    causal = context is None
    # the oracle's own leaves: copies of the state dict, three tensors per projection kind
    w = {k: t.detach().clone().requires_grad_() for k, t in layer.state_dict().items()}
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    cs = [None, None] if context is None else [context.clone().requires_grad_() for _ in "ab"]
    out = layer(xs[0], cs[0], masks.causal() if causal else None)
    ref = three_projections(w, xs[1], cs[1], layer.n_heads, layer.n_kv_heads, causal)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)

    g = randn(*out.shape, seed=9)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, atol=1e-12, rtol=0)
    if context is not None:
        torch.testing.assert_close(cs[0].grad, cs[1].grad, atol=1e-12, rtol=0)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    if layer.qkv_proj is not None:  # the fused parameter's gradient, split into its blocks
        for kind in ("weight", "bias") if bias else ("weight",):
            blocks = grads.pop(f"qkv_proj.{kind}").split(layer.qkv_sizes)
            grads |= {f"{n}.{kind}": b for n, b in zip(NAMES, blocks, strict=False)}
    assert set(grads) == set(w)
    for name, grad in grads.items():
        assert w[name].grad.abs().sum() > 0, name  # the comparison is not of two zeros
        torch.testing.assert_close(grad, w[name].grad, atol=1e-12, rtol=0, msg=name)


def test_self_attention_is_one_product_in_training_and_in_inference():
    layer = layer_for("gqa")
    calls = []
    layer.qkv_proj.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    x, _ = inputs_for("gqa", layer)
    layer.train()
    layer(x).sum().backward()
    layer.eval()
    with torch.no_grad():
        layer(x)
    with torch.inference_mode():
        layer(x)
    C, H, G = CASES["gqa"][:3]
    assert calls == [torch.Size([2, 5, (H + 2 * G) * C // H])] * 3


@pytest.mark.parametrize("case", ["self", "gqa", "cross", "cross-other-width"])
def test_training_and_eval_outputs_are_identical_without_dropout(case):
    layer = layer_for(case, seed=5)
    x, context = inputs_for(case, layer, seed=6)
    layer.train()
    trained = layer(x.clone().requires_grad_(), context)  # autograd records
    layer.eval()
    with torch.no_grad():
        evaluated = layer(x, context)
    with torch.inference_mode():
        inferred = layer(x, context)
    assert trained.requires_grad and not evaluated.requires_grad
    assert torch.equal(trained.detach(), evaluated)
    assert torch.equal(evaluated, inferred)


# --- the state dict keeps the three projections ---------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", ["self", "gqa", "cross-other-width"])
def test_state_dict_names_and_shapes_are_those_of_three_linears(case, bias):
    layer = layer_for(case, bias=bias)
    C, H, G, Cc = CASES[case]
    D, G = C // H, G or H
    Cc = Cc or C
    shapes = {"q_proj": (H * D, C), "k_proj": (G * D, Cc), "v_proj": (G * D, Cc)}
    shapes["out_proj"] = (C, H * D)
    expected = {}
    for name in NAMES:
        expected[f"{name}.weight"] = shapes[name]
        if bias:
            expected[f"{name}.bias"] = shapes[name][:1]
    sd = layer.state_dict()
    assert list(sd) == list(expected)  # names and their order, as three separate Linears give
    assert {k: tuple(t.shape) for k, t in sd.items()} == expected
    for name in NAMES:  # the entries are the projections' weights
        proj = getattr(layer, name)
        assert torch.equal(sd[f"{name}.weight"], proj.weight)
        assert proj.in_features == expected[f"{name}.weight"][1]
        assert proj.out_features == expected[f"{name}.weight"][0]


def test_state_dict_entries_alias_the_fused_parameter_like_any_state_dict():
    layer = layer_for("gqa")
    sd = layer.state_dict()
    with torch.no_grad():
        sd["k_proj.weight"].fill_(0.5)  # e.g. an EMA written into a state dict in place
    assert torch.equal(layer.k_proj.weight, torch.full_like(layer.k_proj.weight, 0.5))
    assert not layer.q_proj.weight.eq(0.5).all() and not layer.v_proj.weight.eq(0.5).all()
    assert not sd["q_proj.weight"].requires_grad


@pytest.mark.parametrize("case", ["self", "gqa", "cross-other-width"])
def test_state_dict_round_trips_through_load_and_safetensors(case, tmp_path):
    a, b = layer_for(case, seed=1), layer_for(case, seed=2)
    x, context = inputs_for(case, a)
    assert not torch.equal(a(x, context), b(x, context))
    save_file(a.state_dict(), tmp_path / "w.safetensors")  # views of one tensor save as three
    b.load_state_dict(load_file(tmp_path / "w.safetensors"))
    assert torch.equal(a(x, context), b(x, context))
    assert all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())


def _old_style_state(C: int, H: int, G: int, seed: int) -> dict[str, Tensor]:
    """A state dict as three separate Linears wrote it: independent q/k/v tensors."""
    torch.manual_seed(seed)
    D = C // H
    sizes = {"q_proj": H * D, "k_proj": G * D, "v_proj": G * D}
    linears = {n: nn.Linear(C, s).double() for n, s in sizes.items()}
    linears["out_proj"] = nn.Linear(H * D, C).double()
    state = {}
    for name, lin in linears.items():
        nn.init.normal_(lin.bias)
        state |= {f"{name}.{k}": t.clone() for k, t in lin.state_dict().items()}
    return state


def test_an_old_style_state_dict_loads_and_gives_the_three_projection_outputs():
    C, H, G = 24, 6, 2
    old = _old_style_state(C, H, G, seed=3)
    layer = MultiHeadAttention(C, H, n_kv_heads=G).double()
    result = layer.load_state_dict(old)
    assert not result.missing_keys and not result.unexpected_keys
    x = randn(2, 5, C, seed=4)
    with torch.no_grad():
        out = layer(x, mask=masks.causal())
    ref = three_projections(old, x, None, H, G, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert all(torch.equal(t, old[k]) for k, t in layer.state_dict().items())


def test_an_old_style_state_dict_loads_inside_a_model_under_its_prefix():
    block = Block(BlockConfig(d_model=16, n_heads=4, n_kv_heads=2, cross_attention=True))
    state = {k: torch.randn_like(t) for k, t in block.state_dict().items()}
    assert "attn.q_proj.weight" in state and "cross_attn.v_proj.bias" in state
    fresh = Block(BlockConfig(d_model=16, n_heads=4, n_kv_heads=2, cross_attention=True))
    fresh.load_state_dict(state)  # strict
    assert all(torch.equal(t, state[k]) for k, t in fresh.state_dict().items())


def test_an_old_style_state_dict_loads_into_a_layer_built_on_meta_with_assign():
    C, H, G = 24, 6, 2
    old = _old_style_state(C, H, G, seed=5)
    with torch.device("meta"):  # built without memory, then given the checkpoint's tensors
        layer = MultiHeadAttention(C, H, n_kv_heads=G).double()
    layer.load_state_dict(old, assign=True)
    assert layer.qkv_proj.weight.device.type == "cpu" and layer.qkv_proj.weight.requires_grad
    assert all(torch.equal(t, old[k]) for k, t in layer.state_dict().items())


def test_q_k_v_lying_one_after_another_load_with_assign_as_one_view():
    """Blocks of one tensor (a file that stores q/k/v whole, mapped): assigned as that tensor's
    view, nothing copied; blocks from apart are joined into a copy."""
    C, H, G = 24, 6, 2
    old = _old_style_state(C, H, G, seed=5)
    names = ("q_proj", "k_proj", "v_proj")
    for kind in ("weight", "bias"):
        whole = torch.cat([old[f"{n}.{kind}"] for n in names])
        sizes = [old[f"{n}.{kind}"].shape[0] for n in names]
        old |= {f"{n}.{kind}": t for n, t in zip(names, whole.split(sizes), strict=True)}
    with torch.device("meta"):
        layer = MultiHeadAttention(C, H, n_kv_heads=G).double()
    layer.load_state_dict(old, assign=True)
    w = layer.qkv_proj.weight
    assert w.data_ptr() == old["q_proj.weight"].data_ptr() and w.shape == (C + 2 * 8, C)
    assert torch.equal(w[C : C + 8], old["k_proj.weight"])
    apart = _old_style_state(C, H, G, seed=5)  # separate tensors: a copy of the three
    with torch.device("meta"):
        layer = MultiHeadAttention(C, H, n_kv_heads=G).double()
    layer.load_state_dict(apart, assign=True)
    assert layer.qkv_proj.weight.data_ptr() != apart["q_proj.weight"].data_ptr()
    assert all(torch.equal(t, apart[k]) for k, t in layer.state_dict().items())


def test_a_state_dict_with_the_fused_name_loads_as_it_is():
    a, b = layer_for("gqa", seed=1), layer_for("gqa", seed=2)
    b.load_state_dict({n: p.detach() for n, p in a.named_parameters()})  # qkv_proj.weight, …
    assert all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())


def test_a_missing_or_misshapen_projection_is_reported_by_its_own_name():
    layer = layer_for("gqa")
    before = {k: t.clone() for k, t in layer.state_dict().items()}
    state = dict(before)
    del state["k_proj.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"k_proj.weight\""):
        layer.load_state_dict(state)
    # not strict: what is given loads, what is absent stays and is reported
    state["q_proj.weight"] = torch.zeros_like(state["q_proj.weight"])
    result = layer.load_state_dict(state, strict=False)
    assert result.missing_keys == ["k_proj.weight"] and not result.unexpected_keys
    assert torch.equal(layer.q_proj.weight, torch.zeros_like(layer.q_proj.weight))
    assert torch.equal(layer.k_proj.weight, before["k_proj.weight"])
    state = dict(before) | {"v_proj.weight": torch.zeros(3, 24, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match=r"size mismatch for v_proj.weight.*\(3, 24\)"):
        layer.load_state_dict(state)


def test_a_bias_for_a_layer_without_biases_is_unexpected():
    layer = layer_for("self", bias=False)
    state = layer.state_dict() | {"q_proj.bias": torch.zeros(24, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*q_proj.bias"):
        layer.load_state_dict(state)


# --- the q/k/v_proj views -------------------------------------------------------------------------


def test_the_projection_views_project_and_write_through():
    layer = layer_for("gqa")
    x = randn(2, 3, 24, seed=7)
    for name in ("q_proj", "k_proj", "v_proj"):
        proj = getattr(layer, name)
        assert isinstance(proj, LinearRows) and not isinstance(proj, nn.Linear)
        torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), atol=0, rtol=0)
    with torch.no_grad():
        layer.v_proj.weight.copy_(torch.ones_like(layer.v_proj.weight))  # into the fused weight
    assert layer.qkv_proj.weight[-layer.v_proj.out_features :].eq(1).all()
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias"]


def test_a_copy_views_its_own_weights():
    layer = layer_for("self")
    twin = copy.deepcopy(layer)
    assert twin.q_proj.source is twin.qkv_proj and twin.qkv_proj is not layer.qkv_proj
    with torch.no_grad():
        twin.qkv_proj.weight.zero_()
    assert twin.k_proj.weight.eq(0).all() and not layer.k_proj.weight.eq(0).all()
    half = copy.deepcopy(layer).to(torch.float32)  # the views follow a conversion
    assert half.q_proj.weight.dtype == torch.float32


def test_cross_attention_with_a_cache_projects_the_context_once():
    """k_proj is one object that the layer calls, so it can be observed (and patched)."""
    layer = layer_for("cross").eval()
    calls = []
    layer.k_proj.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    x, context = inputs_for("cross", layer)
    cache = KVCache(2, layer.n_kv_heads, context.shape[1], layer.head_dim, dtype=torch.float64)
    with torch.no_grad():
        first = layer(x[:, :1], context, cache=cache)
        second = layer(x[:, :1], context, cache=cache)
    assert calls == [context.shape]
    assert torch.equal(first, second)


def test_a_cross_only_layer_called_without_context_says_so():
    layer = layer_for("cross-other-width")
    with pytest.raises(ValueError, match=r"context of width 10 \(context_dim\).*pass a context"):
        layer(randn(1, 3, 24, seed=0))


def test_from_torch_keeps_float64_weights_exactly():
    torch.manual_seed(8)
    m = nn.MultiheadAttention(16, 4, batch_first=True).double().eval()
    with torch.no_grad():
        m.in_proj_bias.normal_()
    ours = MultiHeadAttention.from_torch(m)
    assert ours.qkv_proj.weight.dtype == torch.float64
    assert torch.equal(ours.qkv_proj.weight, m.in_proj_weight)
    assert torch.equal(ours.qkv_proj.bias, m.in_proj_bias)
    x = randn(2, 5, 16, seed=9)
    with torch.no_grad():
        ref, _ = m(x, x, x)
        out = ours(x)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_initial_weights_are_those_of_three_linears_built_in_turn():
    """A seeded layer starts from the weights that q, k and v nn.Linears built in turn get."""
    torch.manual_seed(11)
    layer = MultiHeadAttention(24, 6, n_kv_heads=2)
    torch.manual_seed(11)
    q, k, v = nn.Linear(24, 24), nn.Linear(24, 8), nn.Linear(24, 8)
    out = nn.Linear(24, 24)
    for name, lin in zip(NAMES, (q, k, v, out), strict=True):
        assert torch.equal(getattr(layer, name).weight, lin.weight), name
        assert torch.equal(getattr(layer, name).bias, lin.bias), name


def test_linear_rows_must_be_a_range_of_the_source():
    lin = Linear(4, 6)
    with pytest.raises(ValueError, match=r"rows \[2, 7\) do not fit the 6 output features"):
        LinearRows(lin, 2, 7)
    with pytest.raises(ValueError, match="stop"):
        LinearRows(lin, 3, 2)
    with pytest.raises(TypeError, match="dikkat Linear"):
        LinearRows(nn.Linear(4, 6), 0, 2)
