"""The sparse mixture of experts (dikkat.layers.SparseMoE) against the formula written out here
token by token in fp64, against transformers' Qwen3-MoE block on the same weights, and reading
only the experts its tokens picked."""

from __future__ import annotations

import math

import pytest
import torch

from dikkat.layers import SparseMoE


def moe(seed: int = 0, **options) -> SparseMoE:
    torch.manual_seed(seed)
    settings = dict(n_experts=6, top_k=2) | options
    layer = SparseMoE(12, 10, **settings).double()
    with torch.no_grad():  # logits of O(1), so that the picks are not near-ties
        layer.router.weight.mul_(30)
    return layer


def formula(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Σᵢ pᵢ · down(silu(gate x) ∘ up x) over the top-k experts of each token, one at a time."""
    out = torch.zeros_like(x).reshape(-1, x.shape[-1])
    for n, token in enumerate(x.reshape(-1, x.shape[-1]).tolist()):
        logits = [sum(w * t for w, t in zip(row, token, strict=True))
                  for row in layer.router.weight.tolist()]  # fmt: skip
        top = max(logits)
        probs = [math.exp(v - top) for v in logits]
        probs = [p / sum(probs) for p in probs]
        picked = sorted(range(len(probs)), key=lambda e: -probs[e])[: layer.top_k]
        total = sum(probs[e] for e in picked) if layer.norm_topk else 1.0
        t = torch.tensor(token, dtype=torch.float64)
        for e in picked:
            expert = layer.experts[e]
            gate, up = expert.gate.weight @ t, expert.up.weight @ t
            hidden = gate / (1 + torch.exp(-gate)) * up
            out[n] += probs[e] / total * (expert.down.weight @ hidden)
    return out.view(x.shape)


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_the_layer_is_the_formula(norm_topk, top_k):
    layer = moe(top_k=top_k, norm_topk=norm_topk)
    x = torch.randn(2, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), formula(layer, x), atol=1e-12, rtol=0)


def test_one_token_alone_is_the_formula_and_its_row_of_a_batch():
    """A decode step's token takes a shorter path (no gradients): the same sum."""
    layer = moe()
    x = torch.randn(1, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        batch = layer(x)
        for t in range(4):
            alone = layer(x[:, t : t + 1])
            torch.testing.assert_close(alone, formula(layer, x[:, t : t + 1]), atol=1e-12, rtol=0)
            torch.testing.assert_close(alone[0, 0], batch[0, t], atol=1e-12, rtol=0)


def test_the_router_learns_through_the_weights():
    """With gradients on, one token too goes the way that carries them to the router."""
    layer = moe()
    x = torch.randn(1, 1, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    layer(x).sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_only_the_experts_the_tokens_picked_are_read():
    """Experts no token picked may hold anything: their weights are not read."""
    layer = moe()
    x = torch.randn(1, 3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = layer(x)
        picked = set(layer.route(x.view(-1, 12))[1].flatten().tolist())
        unpicked = sorted(set(range(layer.n_experts)) - picked)
        assert unpicked  # 3 tokens × 2 of 6 experts, at this seed
        for e in unpicked:
            for p in layer.experts[e].parameters():
                p.fill_(float("nan"))
        assert torch.equal(layer(x), want)


def test_the_layer_is_transformers_qwen3_moe_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=12, moe_intermediate_size=10, num_experts=6,
                                         num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    theirs = Qwen3MoeSparseMoeBlock(config).eval()
    ours = moe().float().eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        for e, expert in enumerate(ours.experts):
            theirs.experts.gate_up_proj[e].copy_(torch.cat([expert.gate.weight, expert.up.weight]))
            theirs.experts.down_proj[e].copy_(expert.down.weight)
        x = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="top_k=3 experts a token, of n_experts=2"):
        SparseMoE(8, 4, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="n_experts"):
        SparseMoE(8, 4, n_experts=0, top_k=1)
    with pytest.raises(ValueError, match="activation"):
        SparseMoE(8, 4, n_experts=2, top_k=1, activation="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 8\), got \(2, 3, 5\)"):
        SparseMoE(8, 4, n_experts=2, top_k=1)(torch.randn(2, 3, 5))


def test_a_traced_layer_runs_the_experts_op_and_finds_its_copies():
    """Traced (torch.compile, fullgraph: no break at the routing's host read), the layer is one
    opaque op that finds its layer by the router's values — a deep copy's too."""
    import copy

    from dikkat.layers.moe import experts_op

    layer = moe().float().eval()
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.router.weight.mul_(-1)  # other picks
        x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(4))
        traced = torch.compile(twin, backend="eager", fullgraph=True)
        torch.testing.assert_close(traced(x), twin(x), atol=0, rtol=0)
        flat = x.view(-1, 12)
        mixed = experts_op()(flat, *layer.route(flat), layer.router.weight.clone())
        torch.testing.assert_close(mixed.view(x.shape), layer(x))
        assert not torch.equal(twin(x), layer(x))
