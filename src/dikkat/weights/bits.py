"""How a packed weight's integers lie in its bytes, row by row: 8, 6 or 4 bits a value.

A row of K values is cut into blocks of 32. Value v of a block (i = v mod 16, h = v div 16):

- 8 bits: byte v of the block's 32.
- 4 bits (16 bytes a block): byte i, its low nibble for h = 0 and its high nibble for h = 1 —
  ggml's Q4_0 order (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
- 6 bits (24 bytes a block): its low 4 bits as the 4-bit layout holds them (bytes 0–15); its
  top 2 bits in byte 16 + 2 (i div 4) + (i mod 2), at bit 2 (2 ((i div 2) mod 2) + h).

The 6-bit order is the kernel's: a group's 32-byte chunk of top bits (two bytes of 16 rows)
widened to 16-bit words gives, by one shift of 4, 2, 0 or −2 and a mask, the top bits of the
four pairs of values that four chunks of low nibbles hold (``qmm.cpp``). 5-bit formats (Q5_0,
Q5_K) use the 6-bit layout with their top bit clear.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BITS", "pack", "unpack_values"]

BITS = (4, 6, 8)  # the widths the kernel reads
_GROUP = 32  # values a block
# the bit of value v's top 2 bits in its byte, for v = 16 h + 4 p + 2 q + e: shift[h, q]
_TOP_SHIFT = torch.tensor([[0, 4], [2, 6]], dtype=torch.uint8)


def pack(q: Tensor, bits: int) -> Tensor:
    """Integers q (N, K) in [0, 2^bits) → (N, K · bits / 8) uint8 in the layout above."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    q = q.to(torch.uint8)
    if bits == 8:
        return q
    N, K = q.shape
    halves = q.view(N, K // _GROUP, 2, _GROUP // 2)  # (N, blocks, h, i)
    nibbles = (halves[:, :, 0] & 0x0F) | ((halves[:, :, 1] & 0x0F) << 4)  # (N, blocks, 16)
    if bits == 4:
        return nibbles.reshape(N, K // 2)
    top = (halves >> 4).view(N, K // _GROUP, 2, 4, 2, 2)  # (N, blocks, h, p, q, e)
    shifted = top << _TOP_SHIFT.view(2, 1, 2, 1)  # bit 2 (2 q + h)
    high = shifted.sum(dim=(2, 4), dtype=torch.uint8)  # (N, blocks, p, e): disjoint bits
    return torch.cat([nibbles, high.reshape(N, K // _GROUP, 8)], dim=2).reshape(N, K * 3 // 4)


def unpack_values(values: Tensor, bits: int) -> Tensor:
    """Bytes (N, K · bits / 8) in the layout above → the integers (N, K) uint8."""
    if bits == 8:
        return values
    N = values.shape[0]
    K = values.shape[1] * 8 // bits
    per_block = _GROUP * bits // 8
    blocks = values.reshape(N, K // _GROUP, per_block)
    nibbles = blocks[:, :, None, :16]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # (N, blocks, h, i)
    if bits == 6:
        high = blocks[:, :, 16:].reshape(N, K // _GROUP, 1, 4, 1, 2)  # (N, blocks, ·, p, ·, e)
        top = (high >> _TOP_SHIFT.view(2, 1, 2, 1)) & 3  # (N, blocks, h, p, q, e)
        q = q | (top.reshape(N, K // _GROUP, 2, 16) << 4)
    return q.reshape(N, K)
