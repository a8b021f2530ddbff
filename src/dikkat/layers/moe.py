"""A sparse mixture of experts in place of a block's MLP (Shazeer et al. 2017, "Outrageously
Large Neural Networks", arXiv:1701.06538; the routing of Qwen3-MoE and Mixtral).

Notation: ``C`` width, ``H`` an expert's hidden width, ``E`` experts, ``k`` experts a token.

For each token x: the router's logits ``x Wᵣᵀ`` (E,), their softmax p, and the k largest of p
with their experts e₁ … e_k (renormalised to sum to 1 where ``norm_topk``, as Qwen3-MoE's
``norm_topk_prob``); then ``y = Σᵢ pᵢ · expert_{eᵢ}(x)``, each expert a gated MLP
``down(act(gate(x)) ∘ up(x))``. Only the experts some token picked run, each once on all of its
tokens: a step reads the weights of the experts it uses and no others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.layers.inputs import check_meets
from dikkat.layers.mlp import GateActivation, gate_activation
from dikkat.validate import check_bool, check_int

__all__ = ["SparseMoE"]


class SparseMoE(nn.Module):
    """x (B, T, C) → (B, T, C): each token through the ``top_k`` of ``n_experts`` gated MLPs its
    router picks, their outputs weighted by the router's probabilities (see the module doc).

    Parameters: ``router`` (E, C); ``gate_up`` (E, 2H, C), each expert's gate rows then up rows;
    ``down`` (E, C, H) — the layout of transformers' ``Qwen3MoeExperts``; GGUF files store gate,
    up and down as ``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``.

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
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.act = gate_activation(activation)
        for w in (self.router.weight, self.gate_up, self.down):
            nn.init.normal_(w, std=0.02)

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
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():  # the experts some token picked, in index order
            token, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(flat[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return (
            f"{self.d_model}, {self.hidden}, n_experts={self.n_experts}, top_k={self.top_k}, "
            f"norm_topk={self.norm_topk}"
        )
