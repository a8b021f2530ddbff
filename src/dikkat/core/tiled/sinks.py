"""Attention sinks in the tiled backend: one more logit per row in the softmax's denominator.

Notation: ``B`` batch, ``H`` query heads, ``T`` query length, ``Dv`` value head dim.

A sink σ (gpt-oss learns one per head; docs/attention.md, "Attention sinks") is a score whose
value is 0: the weights become exp(s_j − L) with L = log(exp(σ) + Σ_j exp(s_j)), so they sum to
less than 1 and a row with no visible key puts all its weight on the sink. The tiles run as if
there were none; the sink joins each row's online softmax once its key tiles are merged —
L = logaddexp(lse, σ), out · exp(lse − L) — which is the same as starting the row with the sink
as its maximum and sum 1. The backward is then the usual one: each tile recomputes its weights
from the final L, and rowsum(dO ∘ O) uses the final output, so dq, dk and dv need no change. The
sink's own gradient is that of a score with value 0: dσ = p_σ · (0 − rowsum(dO ∘ O)), with
p_σ = exp(σ − L), summed over the rows that share the sink.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dikkat.core.tiled.kernel import acc_dtype


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out (B, H, T, Dv), lse (B, H, T)) of the softmax over the keys → those with the sinks
    (B|1, H|1, T|1) in its denominator. A row with no visible key (lse −inf, out 0) gets lse σ
    and out 0. Computed in lse's dtype (the accumulator's)."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype))  # finite, as the sink is
    return out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype), total


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """The gradient of the sinks (their shape and dtype) given the final out (B, H, T, Dv), its
    gradient and the final lse (B, H, T), which counts the sinks."""
    acc = acc_dtype(out.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # rowsum(dO ∘ O), (B, H, T)
    p_sink = torch.exp(sinks.to(acc) - lse.to(acc))  # the sink's weight in each row
    return (-p_sink * delta).sum_to_size(sinks.shape).to(sinks.dtype)
