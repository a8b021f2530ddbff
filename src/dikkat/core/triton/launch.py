"""What every kernel launch of one call shares: block sizes, scale, offsets, dot precision.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length, ``D``/``Dv`` head dims,
``BM``/``BN`` query/key rows per block.

No triton here: the host side of a call is plain Python, so that planning and validation run
(and are tested) without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.core.triton.blocks import BlockPlan

__all__ = ["Launch", "choose_blocks"]

# Under triton's interpreter every program runs as numpy on the CPU: small blocks keep the tests'
# tensors small and ragged tails many.
INTERPRETER_BLOCK = 16
NUM_WARPS = 4  # per program: a design bound, like the block sizes below


def choose_blocks(D: int, Dv: int, interpreted: bool) -> tuple[int, int]:
    """``(BM, BN)`` for head dims D, Dv.

    Design bounds, not measurements (nothing here has been timed on a GPU): 64 × 64 blocks with
    :data:`NUM_WARPS` warps, halved past D = 128 so that the dK/dV kernel's two fp32
    accumulators (BN × D each) stay in registers. The forward and backward passes share one
    block plan, hence one block size."""
    if interpreted:
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK
    if max(D, Dv) <= 128:
        return 64, 64
    return 32, 32


def _padded(d: int) -> int:
    """A head dim rounded up to a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, 1 << (d - 1).bit_length())


@dataclass(frozen=True)
class Launch:
    """The scalars and constants every kernel of a call takes."""

    scale: float
    q_offset: int
    D: int
    Dv: int
    dtype: torch.dtype

    @property
    def block_d(self) -> int:
        return _padded(self.D)

    @property
    def block_dv(self) -> int:
        return _padded(self.Dv)

    @property
    def precision(self) -> str:
        """``tl.dot``'s input precision: fp32 inputs are multiplied in full fp32 ("ieee"), not
        in TF32, which would keep 10 bits of mantissa (the 2× rule is against fp32's own)."""
        return "ieee" if self.dtype == torch.float32 else "tf32"

    @property
    def num_warps(self) -> int:
        return NUM_WARPS

    def band(self, plan: BlockPlan) -> tuple[int, int]:
        return (0, 0) if plan.band is None else plan.band

    @staticmethod
    def bias_strides(bias: Tensor | None) -> tuple[int, int, int, int]:
        """A 4-D bias's strides, 0 for a broadcast dimension; zeros without a bias."""
        if bias is None:
            return 0, 0, 0, 0
        return tuple(0 if n == 1 else s for n, s in zip(bias.shape, bias.stride(), strict=True))  # type: ignore[return-value]
