"""The byte layouts of packed integers (dikkat.weights.bits), against the rule its notes
state, computed value by value."""

from __future__ import annotations

import pytest
import torch

from dikkat.weights.bits import pack, unpack_values


def by_the_rule(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout written out one value at a time: value v of a block (i = v mod 16,
    h = v div 16) in the low (h = 0) or high nibble of byte i; for 6 bits its top 2 bits in
    byte 16 + 2 (i div 4) + i mod 2, at bit 2 (2 ((i div 2) mod 2) + h)."""
    N, K = q.shape
    per_block = 32 * bits // 8
    out = torch.zeros(N, K // 32 * per_block, dtype=torch.int64)
    for n in range(N):
        for k in range(K):
            block, v = divmod(k, 32)
            i, h, value = v % 16, v // 16, int(q[n, k])
            out[n, block * per_block + i] |= (value & 0x0F) << (4 * h)
            if bits == 6:
                top = block * per_block + 16 + (i // 4) * 2 + i % 2
                out[n, top] |= (value >> 4) << (2 * (2 * ((i // 2) % 2) + h))
    return out.to(torch.uint8)


@pytest.mark.parametrize("bits", [4, 6])
def test_the_bytes_follow_the_stated_rule_and_unpack_to_the_integers(bits):
    q = torch.randint(0, 2**bits, (3, 96), generator=torch.Generator().manual_seed(bits),
                      dtype=torch.uint8)  # fmt: skip
    packed = pack(q, bits)
    assert packed.shape == (3, 96 * bits // 8)
    assert torch.equal(packed, by_the_rule(q, bits))
    assert torch.equal(unpack_values(packed, bits), q)


def test_eight_bits_are_the_integers_and_other_widths_are_refused():
    q = torch.randint(0, 256, (2, 32), dtype=torch.uint8)
    assert torch.equal(pack(q, 8), q) and torch.equal(unpack_values(q, 8), q)
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 6, 8\), got 5"):
        pack(q, 5)
