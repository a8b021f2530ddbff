"""What an attention function returns besides its output.

The convention (docs/attention.md, "What attention returns"): ``out`` when no extra is asked for,
``(out, aux)`` when one is, where ``aux`` is an :class:`AttentionAux` whose fields not asked for
are None. The result's type depends only on whether an extra was asked for, never on which —
as FlexAttention's ``return_aux`` returns ``(out, AuxOutput)``
(https://pytorch.org/docs/stable/nn.attention.flex_attention.html).

Notation: ``B`` batch, ``H`` query heads, ``T`` query length, ``S`` key length.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["AttentionAux"]


class AttentionAux(NamedTuple):
    """The extras of an attention call; a field not asked for is None.

    A NamedTuple, so it unpacks: ``out, (weights, lse) = attention(..., return_weights=True,
    return_lse=True)``.
    """

    weights: Tensor | None  # (B, H, T, S), each row summing to 1 (0 for a row with no key)
    lse: Tensor | None  # (B, H, T) log-sum-exp of each row's scores, fp32 (fp64 for fp64)
