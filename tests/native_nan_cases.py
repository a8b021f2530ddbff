"""A NaN or ±Inf in what dikkat's packed product multiplies, and the checks that its outputs are
what IEEE arithmetic gives for the dequantised weight times x (in fp64): used in the tests'
process (tests/kernels/test_nan.py) and, for builds without AVX-512, in a process of their
own (tests/kernels/test_portable.py).

Every format dikkat reads from GGUF files (the GGUF kinds of dikkat.weights.formats.FORMATS) and
its own q8/q4, as random weights of 37 rows (two of the kernel's groups of 16 rows and 5 more,
kept row by row) and 256 input features (one super-block of two-level scales)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dikkat.weights.bits import pack
from dikkat.weights.packed import PackedWeight, _dequantize

N, K = 37, 256
COLUMN = 37  # the input feature that gets the NaN or Inf: in the second block of 32 (or 16)
ZERO_ROWS = (2, 35)  # weight rows whose value at COLUMN is 0 (symmetric formats): Inf · 0 is NaN


@dataclass(frozen=True)
class Format:
    bits: int  # how the kernel holds q: 4, 6 or 8 bits
    block: int  # values a scale
    offsets: bool  # w = scale · q + offset, else scale · (q − zero)
    scales: str  # "f16", "f32", or "two-level" (int8 times fp16 a super-block)
    levels: int  # q in [0, levels): 5-bit formats in the 6-bit layout
    zero: int


FORMATS = {
    "Q8_0": Format(8, 32, False, "f16", 256, 128),
    "Q4_0": Format(4, 32, False, "f16", 16, 8),
    "Q4_1": Format(4, 32, True, "f16", 16, 0),
    "Q5_0": Format(6, 32, False, "f16", 32, 16),
    "Q5_1": Format(6, 32, True, "f16", 32, 0),
    "Q4_K": Format(4, 32, True, "two-level", 16, 0),
    "Q5_K": Format(6, 32, True, "two-level", 32, 0),
    "Q6_K": Format(6, 16, False, "two-level", 64, 32),
    "q8": Format(8, 32, False, "f32", 256, 128),
    "q4": Format(4, 32, False, "f32", 16, 8),
}
# a NaN; an Inf of either sign; both Infs in one row (NaN where a weight's two terms cancel)
BAD = {"nan": [float("nan")], "inf": [float("inf")], "-inf": [float("-inf")],
       "both infs": [float("inf"), float("-inf")]}  # fmt: skip

Product = Callable[[Tensor, PackedWeight], Tensor]


def packed(name: str, seed: int = 0) -> PackedWeight:
    """A random weight (N, K) in format ``name``, row by row."""
    f = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, f.levels, (N, K), generator=g, dtype=torch.uint8)
    if not f.offsets:
        q[list(ZERO_ROWS), COLUMN] = f.zero
    shape = (N, K // f.block)
    if f.scales == "two-level":
        scale, offset = (torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
                         for _ in range(2))  # fmt: skip
        units = [(torch.rand(N, K // 256, generator=g) * 1e-3).half() for _ in range(2)]
        return PackedWeight(
            pack(q, f.bits), scale, offset if f.offsets else None, f.zero, f.bits, f.block,
            name, False, units[0], units[1] if f.offsets else None,
        )  # fmt: skip
    dtype = torch.float16 if f.scales == "f16" else torch.float32
    scale = (torch.randn(shape, generator=g) * 0.01).to(dtype)
    offset = (torch.randn(shape, generator=g) * 0.05).to(dtype) if f.offsets else None
    return PackedWeight(pack(q, f.bits), scale, offset, f.zero, f.bits, f.block, name)


def reference(x: Tensor, p: PackedWeight) -> Tensor:
    """fp64, term by term (a BLAS may skip a zero's products): the dequantised weight times x."""
    w = _dequantize(p.in_rows()).double()
    return (x.double()[:, None, :] * w[None]).sum(-1)


def same_nonfinite(got: Tensor, want: Tensor) -> bool:
    """NaN, +Inf and -Inf exactly where ``want`` has them."""
    return all(
        torch.equal(test(got), test(want)) for test in (torch.isnan, torch.isposinf, torch.isneginf)
    )


def kernel(op: Callable[..., Tensor]) -> Product:
    """The native op as a product of rows x and a weight (in its groups)."""

    def product(x: Tensor, p: PackedWeight) -> Tensor:
        p = p.in_groups()
        return op(x, p.values, p.scale, p.offset, p.super_scale, p.super_offset, p.bits, p.block,
                  p.zero)  # fmt: skip

    return product


def part(p: PackedWeight, which: str) -> Tensor:
    """The floating-point tensor of ``p``'s ``which`` ("scale" or "offset"): as held, or for two
    levels the fp16 super-block values (its int8 ones hold no NaN)."""
    two_level = p.super_scale is not None
    found = {"scale": p.super_scale if two_level else p.scale,
             "offset": p.super_offset if two_level else p.offset}[which]  # fmt: skip
    assert found is not None and found.is_floating_point()
    return found


def check_rows(product: Product, name: str, M: int, bad: str) -> None:
    """Row M // 2 of x (M, K) holds ``bad``: its outputs are the reference's NaN and ±Inf, and
    the other rows are those of the same product without it."""
    p = packed(name, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    m, others = M // 2, [i for i in range(M) if i != M // 2]
    clean = product(x, p)
    for i, value in enumerate(BAD[bad]):
        x[m, COLUMN + 100 * i] = value
    got, want = product(x, p), reference(x, p)
    assert not want[m].isfinite().any(), "the reference's row is not what the case means"
    assert same_nonfinite(got[m], want[m]), f"{name} M={M} {bad}: {got[m]} for {want[m]}"
    assert torch.equal(got[others], clean[others]), f"{name} M={M} {bad}: other rows changed"


def check_scales(product: Product, name: str, M: int, bad: str, which: str) -> None:
    """A ``bad`` ("nan" or "inf") scale, or offset, of one block in a row of a group and in a
    row of the last 5 (for two levels, in their fp16 super-block value): NaN outputs where the
    reference is NaN for a NaN; non-finite ones where it is, and only there, for an Inf."""
    p = packed(name, seed=M)
    held = part(p, which)
    for n in (3, N - 2):
        held[n, held.shape[1] // 2] = float(bad)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    got, want = product(x, p), reference(x, p)
    assert not want[:, [3, N - 2]].isfinite().any() and want[:, 4].isfinite().all()
    if bad == "nan":
        assert same_nonfinite(got, want), f"{name} M={M}: {got} for {want}"
    else:
        assert torch.equal(got.isfinite(), want.isfinite()), f"{name} M={M}: {got} for {want}"
