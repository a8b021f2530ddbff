"""A sparse mixture of experts in place of a block's MLP (Shazeer et al. 2017, "Outrageously
Large Neural Networks", arXiv:1701.06538; the routing of Qwen3-MoE and Mixtral).

Notation: ``C`` width, ``H`` an expert's hidden width, ``E`` experts, ``k`` experts a token.

For each token x: the router's logits ``x Wᵣᵀ`` (E,), their softmax p, and the k largest of p
with their experts e₁ … e_k (renormalised to sum to 1 where ``norm_topk``, as Qwen3-MoE's
``norm_topk_prob``); then ``y = Σᵢ pᵢ · expert_{eᵢ}(x)``, each expert a gated MLP
``down(act(gate(x)) ∘ up(x))``. Only the experts some token picked run, each once on all of its
tokens: a step reads the weights of the experts it uses and no others.

Which experts run depends on the values of the routing, which a traced graph (torch.compile,
torch.export: the compiled decode step) cannot hold: there the routing is traced, and the experts
run as one op — experts a file stacked and quantised (``stacked``,
:class:`~dikkat.weights.packed_layers.PackedExperts`) as its native op, any others as an opaque
custom op, ``dikkat::experts`` (PyTorch's "Custom Python Operators" tutorial), whose
implementation is the eager :meth:`SparseMoE.mix`. That op takes the router's weight too,
by which it finds its layer (:func:`_layer_of`): a compiled program kept on disk binds its
constants to the model's tensors when a later process loads it
(:mod:`dikkat.models.aot_package`), so the router it passes is always the loaded model's. Two
live layers with equal routers are taken to be copies of one layer.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dikkat.layers.inputs import check_meets
from dikkat.layers.mlp import GateActivation, GatedMLP
from dikkat.validate import check_bool, check_int

__all__ = ["SparseMoE"]


class SparseMoE(nn.Module):
    """x (B, T, C) → (B, T, C): each token through the ``top_k`` of ``n_experts`` gated MLPs its
    router picks, their outputs weighted by the router's probabilities (see the module doc).

    ``router`` is a linear layer (E, C); ``experts`` the E :class:`GatedMLP` s, each of which may
    hold its weights as a file keeps them (packed blocks, 16 bits), as any gated MLP does. A GGUF
    file stores one layer's experts stacked: ``ffn_gate_exps`` and ``ffn_up_exps`` (E, H, C),
    ``ffn_down_exps`` (E, C, H); a Hugging Face checkpoint each expert's own
    (``mlp.experts.{e}.gate_proj``).

    >>> import torch
    >>> SparseMoE(16, 8, n_experts=4, top_k=2)(torch.randn(2, 3, 16)).shape
    torch.Size([2, 3, 16])
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        *,
        n_experts: int,
        top_k: int,
        norm_topk: bool = True,
        activation: GateActivation = "silu",
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("hidden", hidden), ("n_experts", n_experts)):
            check_int(name, value)
        check_int("top_k", top_k)
        if top_k > n_experts:
            raise ValueError(f"top_k={top_k} experts a token, of n_experts={n_experts}")
        check_bool("norm_topk", norm_topk)
        self.d_model, self.hidden, self.n_experts, self.top_k = d_model, hidden, n_experts, top_k
        self.norm_topk = norm_topk
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(d_model, hidden, activation=activation) for _ in range(n_experts)
        )
        # the experts held as a file stacks them, run for all tokens at once
        # (dikkat.weights.packed_layers.PackedExperts: ``mix(flat, weights, experts)``, which a
        # trace holds as one op); None: each expert runs as its own module
        self.stacked: nn.Module | None = None
        _LAYERS.add(self)
        experts_op()  # defined before any trace: a trace cannot define it

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy, pickle) is a layer too
        super().__setstate__(state)
        _LAYERS.add(self)

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens (N, C) → the weights (N, k) in the tokens' dtype and the experts (N, k) they
        go to: the softmax of the router's logits in at least fp32, its k largest."""
        logits = self.router(flat)
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(flat.dtype, torch.float32))
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(flat.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        check_meets("x", x, self.router.weight, "SparseMoE")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (..., {self.d_model}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.d_model)
        weights, experts = self.route(flat)
        if self.stacked is not None:  # one native op, traced or not
            mixed = self.stacked.mix(flat, weights, experts)
        elif torch.compiler.is_compiling() or torch.compiler.is_exporting():  # routing traced
            mixed = torch.ops.dikkat.experts(flat, weights, experts, self.router.weight)
        else:
            mixed = self.mix(flat, weights, experts)
        return mixed.view(x.shape)

    def run(self, x: Tensor) -> Tensor:
        """The forward, eagerly, without its checks."""
        flat = x.reshape(-1, self.d_model)
        return self.mix(flat, *self.route(flat)).view(x.shape)

    def mix(self, flat: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Tokens (N, C) through the experts (N, k) they go to, weighted (N, k): the picks read
        on the host, each picked expert run once."""
        if self.stacked is not None:
            return self.stacked.mix(flat, weights, experts)
        if flat.shape[0] == 1 and not torch.is_grad_enabled():  # a decode step: fewer operations
            return self._one(flat, weights[0], experts[0])
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():  # the experts some token picked, in index order
            token, slot = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[token])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    def _one(self, flat: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """One token's output: its experts' in index order, summed as :meth:`mix` sums a
        batch's."""
        picks = sorted(zip(experts.tolist(), weights.tolist(), strict=True))
        out = None
        for e, w in picks:
            y = self.experts[e](flat).mul_(w)
            out = y if out is None else out.add_(y)
        return out  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return (
            f"{self.d_model}, {self.hidden}, n_experts={self.n_experts}, top_k={self.top_k}, "
            f"norm_topk={self.norm_topk}"
        )


_LAYERS: weakref.WeakSet[SparseMoE] = weakref.WeakSet()  # every layer alive, for the op
_FOUND: dict[int, weakref.ref[SparseMoE]] = {}  # where a router the op was given lies → layer


def _layer_of(router: Tensor) -> SparseMoE:
    """The live layer whose router weight holds ``router``'s values. AOTInductor hands a custom
    op its own copy of a constant (made once, as the package is loaded), not the model's
    tensor: the layer is found by value, once per copy, and a copy found before is checked by
    one row (memory freed and reused by another copy would not pass it)."""
    at = router.data_ptr()
    ref = _FOUND.get(at)
    layer = None if ref is None else ref()
    if layer is not None and torch.equal(layer.router.weight[0], router[0]):
        return layer
    for layer in list(_LAYERS):
        w = layer.router.weight
        if w.shape == router.shape and w.dtype == router.dtype and torch.equal(w, router):
            _FOUND[at] = weakref.ref(layer)
            return layer
    raise RuntimeError("dikkat::experts: no live SparseMoE has this router weight")


@functools.cache
def experts_op() -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``dikkat::experts(flat, weights, experts, router_weight)``: :meth:`SparseMoE.mix` of the
    layer of that router; defined when the first layer is built (or a process loads a compiled
    program that calls it), not at import."""

    @torch.library.custom_op("dikkat::experts", mutates_args=())
    def mixed(flat: Tensor, weights: Tensor, experts: Tensor, router: Tensor) -> Tensor:
        with torch.no_grad():
            return _layer_of(router).mix(flat, weights, experts)

    @mixed.register_fake
    def _(flat: Tensor, weights: Tensor, experts: Tensor, router: Tensor) -> Tensor:
        return torch.empty_like(flat)

    return mixed
