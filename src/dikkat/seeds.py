"""The examples of docs/contract.md (§2, §3, §4, §13), computed on real tensors.

Each function returns the numbers; ``dikkat seeds`` prints them beside what docs/contract.md states,
and the tests assert them. Nothing here types a contract number in as a result: the stated values
appear only in :data:`SEED_CLAIMS`, as the text to compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.attention import attention
from dikkat.core.masks import causal, from_torch_mask
from dikkat.layers.attention import MultiHeadAttention

# What docs/contract.md states, quoted so that `dikkat seeds` can show it next to what we compute.
SEED_CLAIMS = {
    "§2 A scores": "(0.707, 0)",
    "§2 A weights": "(0.67, 0.33)",
    "§2 o_A": "[0.67, 0.33]",
    "§2 B scores": "(0.141, 0.707)",
    "§2 B weights": "(0.36, 0.64)",
    "§3": "without √d_k at d_k = 64 the softmax is nearly one-hot",
    "§4": "3 tokens: the upper triangle is −∞",
    "§13 shape": "(1, 5, 5)",
    "§13 shuffle": "True",
    "§13 causal": "lower-triangular; first row 1.00, second 0.31, 0.69; zeros above the diagonal",
}


@dataclass(frozen=True)
class WorkedExample:
    """§2: two tokens, d_k = 2. Rows are the queries A and B, columns the keys A and B."""

    scores: Tensor  # (2, 2) scaled scores q_i · k_j / √2
    weights: Tensor  # (2, 2) softmax rows
    outputs: Tensor  # (2, 2) o_A, o_B


def worked_example() -> WorkedExample:
    """The worked example's tokens A (q = k = v = [1, 0]) and B (q = [0.2, 1], k = v = [0, 1])."""
    q = torch.tensor([[1.0, 0.0], [0.2, 1.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    as4d = lambda t: t.view(1, 1, 2, 2)  # noqa: E731 — (T, D) → (B=1, H=1, T, D)
    out, aux = attention(as4d(q), as4d(k), as4d(v), backend="reference", return_weights=True)
    scores = q @ k.T / math.sqrt(2)
    return WorkedExample(scores, aux.weights[0, 0], out[0, 0])


def causal_exercise(n: int = 3) -> Tensor:
    """§4: the (n, n) grid of score cells the causal mask sets to −∞ (True = −∞)."""
    return ~causal().materialize(1, 1, n, n)[0, 0]


@dataclass(frozen=True)
class ScalingStats:
    """§3: softmax sharpness with and without the 1/√d_k scale."""

    d_k: int
    max_weight_unscaled: float  # mean over rows of the largest weight
    max_weight_scaled: float
    score_var_unscaled: float  # variance of q · k: grows like d_k
    score_var_scaled: float  # ≈ 1 after dividing by √d_k
    entropy_unscaled: float  # mean row entropy in nats (log n_keys is uniform)
    entropy_scaled: float
    n_keys: int


def scaling_experiment(
    d_k: int = 64, n_keys: int = 64, rows: int = 4096, seed: int = 0
) -> ScalingStats:
    """Random unit-variance q and k: how peaked is softmax(q·k) against softmax(q·k / √d_k)?"""
    for name, value in (("d_k", d_k), ("n_keys", n_keys), ("rows", rows)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, d_k, generator=g, dtype=torch.float64)
    k = torch.randn(n_keys, d_k, generator=g, dtype=torch.float64)
    raw = q @ k.T  # (rows, n_keys)

    def stats(scores: Tensor) -> tuple[float, float, float]:
        w = torch.softmax(scores, dim=-1)
        entropy = -(w * torch.log(w.clamp_min(1e-300))).sum(-1)
        return w.max(-1).values.mean().item(), scores.var().item(), entropy.mean().item()

    mu, vu, eu = stats(raw)
    ms, vs, es = stats(raw / math.sqrt(d_k))
    return ScalingStats(d_k, mu, ms, vu, vs, eu, es, n_keys)


@dataclass(frozen=True)
class TorchMHAFacts:
    """§13: the ``nn.MultiheadAttention`` example, run on torch's layer and on ours."""

    weights_shape: tuple[int, ...]  # head-averaged weights of ours
    shuffle_equal: bool  # shuffled inputs give shuffled outputs (no positions)
    causal_weights_torch: Tensor  # (5, 5)
    causal_weights_ours: Tensor  # (5, 5), heads averaged
    max_output_diff: float  # |ours − torch| over the outputs


def torch_mha_facts() -> TorchMHAFacts:
    """Run the §13 script (seed 0, 5 tokens of 16 features, 2 heads) through both layers."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 5, 16)
    attn = torch.nn.MultiheadAttention(embed_dim=16, num_heads=2, batch_first=True)
    ours = MultiHeadAttention.from_torch(attn)
    with torch.no_grad():
        out_torch, _ = attn(tokens, tokens, tokens)
        out, weights = ours(tokens, return_weights=True)
        perm = torch.tensor([3, 0, 4, 1, 2])
        out_shuffled = ours(tokens[:, perm])
        blocked = torch.triu(
            torch.ones(5, 5, dtype=torch.bool), diagonal=1
        )  # torch: True = blocked
        _, causal_torch = attn(tokens, tokens, tokens, attn_mask=blocked)
        _, causal_ours = ours(tokens, mask=from_torch_mask(blocked), return_weights=True)
    return TorchMHAFacts(
        weights_shape=tuple(weights.mean(dim=1).shape),
        shuffle_equal=torch.allclose(out_shuffled, out[:, perm], atol=1e-6),
        causal_weights_torch=causal_torch[0],
        causal_weights_ours=causal_ours.mean(dim=1)[0],
        max_output_diff=(out - out_torch).abs().max().item(),
    )
