"""Linear attention: a kernel feature map instead of the softmax, O(n) time and memory.

The model of Katharopoulos et al. 2020, "Transformers are RNNs" (arXiv:2006.16236), with their
feature map φ(x) = elu(x) + 1.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D``/``Dv`` head dims, ``C`` chunk length.

With φ(x) = elu(x) + 1 (positive features), the weight of key j for query i is
φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j'). Because the numerator factorises, the sums over keys can be
taken first: out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / φ(q_i)ᵀ (Σ_j φ(k_j)) — a (D × Dv) state instead
of a T × S matrix. Causally the sums run over j ≤ i: chunks of C queries use the small quadratic
form inside the chunk and the running state for everything before it. Generation keeps just that
state (:class:`LinearState`), a constant size instead of a growing KV cache.

This is a different model from softmax attention, not an approximation of it; it is tested
against its own quadratic formula (:func:`linear_attention_quadratic`). ``scale`` is not used:
the feature map replaces the softmax's temperature.

A row whose normaliser φ(q_i)ᵀ Σ_j φ(k_j) is 0 — no keys (S = 0), or every feature underflowed —
gives output 0, as a fully masked row does in softmax attention, with finite gradients (so do the
zero-padded rows of the last causal chunk, which are dropped). Through ``dikkat.attention`` it
follows the NaN/∞ rule of :mod:`dikkat.core.attention` with its own reach: row i reaches q_i and
the keys j ≤ i + S − T when causal, every key otherwise (no bias here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dikkat.core import tuning


def feature_map(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 > 0."""
    return F.elu(x) + 1.0


def _normalised(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with 0 where den = 0: there num is 0 too (every weight φ(q_i)·φ(k_j) ≥ 0 is 0),
    and dividing by 1 instead keeps 0/0 out of the forward pass and of the gradients."""
    return num / den.masked_fill(den == 0, 1.0)


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, T, D) → (B, G, g, T, D); k, v (B, G, S, ·) → (B, G, 1, S, ·)."""
    B, H, T, D = q.shape
    G = k.shape[1]
    return q.reshape(B, G, H // G, T, D), k.unsqueeze(2), v.unsqueeze(2)


def linear_attention_quadratic(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
    """The same model written the slow way, with its T × S weights: the oracle for the tests."""
    B, H, T, _ = q.shape
    qg, kg, vg = _grouped(feature_map(q), feature_map(k), v)
    w = qg @ kg.transpose(-2, -1)  # (B, G, g, T, S): φ(q_i)·φ(k_j)
    if causal:
        S = k.shape[2]
        w = w * torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    w = _normalised(w, w.sum(-1, keepdim=True))
    return (w @ vg).reshape(B, H, T, v.shape[-1])


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    chunk: int | None = None,
    segment: int | None = None,
) -> Tensor:
    """Linear attention, (B, H, T, Dv). Causal needs the queries to be the last T of the S keys.

    ``chunk`` (C: keys of a chunk summed among themselves, C × C) and ``segment`` (rows per
    pass) shape only the causal computation, not its result; None: the device's values in
    :mod:`dikkat.core.tuning`."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    tune = tuning.for_device(q.device)
    chunk = tune.linear_chunk if chunk is None else chunk
    segment = tune.linear_segment if segment is None else segment
    if chunk <= 0 or segment <= 0:
        raise ValueError(f"chunk and segment must be positive, got {chunk} and {segment}")
    if not causal:
        qg, kg, vg = _grouped(feature_map(q), feature_map(k), v)
        state = kg.transpose(-2, -1) @ vg  # (B, G, 1, D, Dv): Σ_j φ(k_j) v_jᵀ
        norm = kg.sum(-2)  # (B, G, 1, D): Σ_j φ(k_j)
        out = _normalised(qg @ state, qg @ norm.unsqueeze(-1))
        return out.reshape(B, H, T, v.shape[-1])
    qg, kg, vg = _grouped(q, k, v)  # φ is applied segment by segment, below
    # keys before the first query are visible to every query: they start the running state
    first = S - T
    k_first = feature_map(kg[..., :first, :])
    state = k_first.transpose(-2, -1) @ vg[..., :first, :]  # (B, G, 1, D, Dv)
    norm = k_first.sum(-2)  # (B, G, 1, D)
    if T == 0:  # no queries: an empty output that still reaches k and v through the graph
        return (qg @ state).reshape(B, H, T, v.shape[-1])
    # segments of ``segment`` rows keep the working set small (the feature map included, and
    # each segment's output written in place), so the cost per token stays flat
    out = torch.empty(*qg.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for s0 in range(0, T, segment):
        s1 = min(s0 + segment, T)
        out[..., s0:s1, :], state, norm = _causal_segment(
            feature_map(qg[..., s0:s1, :]),
            feature_map(kg[..., first + s0 : first + s1, :]),
            vg[..., first + s0 : first + s1, :],
            state,
            norm,
            chunk,
        )
    return out.reshape(B, H, T, v.shape[-1])


def _causal_segment(
    qg: Tensor, kg: Tensor, vg: Tensor, state0: Tensor, norm0: Tensor, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Causal linear attention of a segment whose query i is key i, given the state of the keys
    before it; returns (out (B, G, g, T, Dv), the state and norm after the segment). All chunks
    at once: T is zero-padded to n·C (padded keys come after every real query, so the causal
    order keeps them out; padded rows are dropped)."""
    T = qg.shape[-2]
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(x: Tensor) -> Tensor:  # (…, T, ·) → (…, n, C, ·)
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.reshape(*x.shape[:-2], n, chunk, x.shape[-1])

    qc, kc, vc = chunks(qg), chunks(kg), chunks(vg)
    # the state each chunk starts from: the keys before it, an exclusive prefix sum over chunks
    kv = kc.transpose(-2, -1) @ vc  # (B, G, 1, n, D, Dv): each chunk's Σ φ(k) vᵀ
    kv_before = kv.cumsum(3)
    state = state0.unsqueeze(3) + kv_before - kv
    ksum = kc.sum(-2)  # (B, G, 1, n, D)
    k_before = ksum.cumsum(3)
    norm = norm0.unsqueeze(3) + k_before - ksum
    inside = (qc @ kc.transpose(-2, -1)).tril()  # causal within each chunk, (B, G, g, n, C, C)
    num = qc @ state + inside @ vc  # (B, G, g, n, C, Dv)
    den = (qc @ norm.unsqueeze(-1)).squeeze(-1) + inside.sum(-1)
    # a padded row has φ(q) = 0 (padding comes after the feature map): 0/0 without _normalised
    out = _normalised(num, den.unsqueeze(-1)).flatten(-3, -2)[..., :T, :]  # (B, G, g, T, Dv)
    return out, state0 + kv_before[:, :, :, -1], norm0 + k_before[:, :, :, -1]


@dataclass
class LinearState:
    """The recurrent form's memory: Σ φ(k) vᵀ (B, G, 1, D, Dv) and Σ φ(k) (B, G, 1, D)."""

    kv: Tensor
    k: Tensor

    @classmethod
    def empty(
        cls,
        B: int,
        G: int,
        D: int,
        Dv: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> LinearState:
        return cls(
            torch.zeros(B, G, 1, D, Dv, dtype=dtype, device=device),
            torch.zeros(B, G, 1, D, dtype=dtype, device=device),
        )

    @property
    def nbytes(self) -> int:
        """Constant in the sequence length, unlike a KV cache."""
        return self.kv.numel() * self.kv.element_size() + self.k.numel() * self.k.element_size()


def linear_attention_step(state: LinearState, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One token: q (B, H, 1, D), k (B, G, 1, D), v (B, G, 1, Dv) → out (B, H, 1, Dv).

    Adds the token's key and value to ``state`` (in place), then reads the state: the causal
    result for this position, at a cost that does not grow with the sequence.
    """
    qg, kg, vg = _grouped(feature_map(q), feature_map(k), v)
    state.kv += kg.transpose(-2, -1) @ vg
    state.k += kg.sum(-2)
    out = _normalised(qg @ state.kv, qg @ state.k.unsqueeze(-1))
    return out.reshape(q.shape[0], q.shape[1], 1, v.shape[-1])
