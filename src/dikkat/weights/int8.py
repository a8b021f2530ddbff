"""The int8 weight formats: int8 weight-only and w8a8 (int8 weights times 8-bit inputs).

Notation: ``N`` output features, ``K`` input features, ``M`` rows of the input.

Decoding one token reads every weight once, so its speed is set by the bytes of the weights;
bf16 halves them, int8 quarters them. Only the weights change: inputs, outputs, norms, attention
and the KV cache stay in the model's dtype.

int8 weight-only (as in gpt-fast's ``quantize.py``, "int8 weight-only"): each output channel
(row) n of W gets a scale sₙ = maxₖ |Wₙₖ| / 127 and stores qₙₖ = round(Wₙₖ / sₙ) ∈ [−127, 127], so
|Wₙₖ − sₙ qₙₖ| ≤ sₙ / 2. The product ``x @ Wᵀ`` runs as ``(x @ qᵀ) · s`` through PyTorch's
``aten._weight_int8pack_mm`` (bf16 input and scales, so x and s are rounded to bf16 there), or,
where that kernel cannot serve the shape, as a plain product with the dequantised weight.

w8a8 (int8 weights and dynamically quantised 8-bit activations, "W8A8" in Xiao et al. 2023,
SmoothQuant, https://arxiv.org/abs/2211.10438): the same int8 weights, multiplied by FBGEMM's
dynamic quantised linear (``quantized::linear_dynamic``), which rounds each input to 8 bits
with a scale and zero point from its range, multiplies in integers and dequantises the sum.
Its input rounding is coarser than int8's (bf16), so its products are less exact; on CPUs
where ``_weight_int8pack_mm`` is slow (no AVX-512) it is several times faster. FBGEMM takes one
scale for a whole input, so each row is multiplied on its own: a row's result never depends
on the other rows of the batch (a server's requests stay independent).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_INT8_MAX = 127  # symmetric: −128 is never used, so q and −q are both representable
# The CPU kernel of torch 2.13 returns wrong numbers, or crashes, unless K is a multiple of 16
# (tests/weights/test_int8.py runs shapes on both sides of this; BENCHMARKS.md, Generation).
_KERNEL_K_MULTIPLE = 16


@dataclass(frozen=True)
class Int8Weight:
    """A weight (N, K) as int8 ``values`` and one ``scale`` (N,) per output channel (row)."""

    values: Tensor  # (N, K) int8
    scale: Tensor  # (N,) fp32
    scale_bf16: Tensor  # (N,) the scales as the kernel takes them

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 values and the scales (what a product reads)."""
        return self.values.numel() + self.scale.numel() * self.scale.element_size()


def quantize_int8(weight: Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of ``weight`` (N, K): |W − dequantize| ≤ scale / 2.

    A row of zeros gets scale 1 (and zeros), so that no scale is 0. The scales are computed in
    fp32 from the weight as given.
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D floating-point tensor (N, K), got {shape}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # (N,)
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    values = torch.round(w / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return Int8Weight(values.contiguous(), scale, scale.to(torch.bfloat16))


def dequantize_int8(q: Int8Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight (N, K) that ``q`` stands for, ``scale · values``, in ``dtype``."""
    return (q.values.to(torch.float32) * q.scale[:, None]).to(dtype)


def int8_kernel_available() -> bool:
    """Whether this PyTorch has ``aten._weight_int8pack_mm`` (otherwise: dequantise, multiply)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_linear(x: Tensor, q: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """``x @ Wᵀ + bias`` for x (..., K) with W held as ``q``; the result in x's dtype.

    Through ``aten._weight_int8pack_mm`` when it can serve the shape (x and the scales rounded to
    bf16, the sum in the kernel's precision), else through the dequantised weight in x's dtype.
    """
    K = q.values.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x must end in the weight's {K} input features, got {tuple(x.shape)}")
    if int8_kernel_available() and K % _KERNEL_K_MULTIPLE == 0 and x.device.type == "cpu":
        rows = x.reshape(-1, K).to(torch.bfloat16).contiguous()  # (M, K)
        out = torch.ops.aten._weight_int8pack_mm(rows, q.values, q.scale_bf16)
        out = out.to(x.dtype).view(*x.shape[:-1], -1)  # (..., N)
        return out if bias is None else out + bias
    return F.linear(x, dequantize_int8(q, x.dtype), bias)


def rows_of(q: Int8Weight, start: int, stop: int) -> Int8Weight:
    """Output channels [start, stop) of ``q`` (per-channel scales make this exact)."""
    return Int8Weight(q.values[start:stop], q.scale[start:stop], q.scale_bf16[start:stop])


@dataclass(frozen=True)
class W8A8Weight:
    """A weight (N, K) as int8 with per-channel scales (:func:`quantize_int8`'s), and its bias,
    packed for FBGEMM's dynamic quantised linear."""

    packed: object  # torch.ops.quantized.linear_prepack's packed params
    out_features: int
    in_features: int
    nbytes: int  # bytes of the int8 values and the fp32 scales


@functools.cache
def w8a8_available() -> bool:
    """Whether this PyTorch has FBGEMM's dynamic quantised linear (x86 builds with FBGEMM)."""
    ops = getattr(torch.ops, "quantized", None)
    return (
        hasattr(ops, "linear_prepack")
        and hasattr(ops, "linear_dynamic")
        and any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm"))
    )


def quantize_w8a8(weight: Tensor, bias: Tensor | None = None) -> W8A8Weight:
    """``weight`` (N, K) as :func:`quantize_int8`'s int8 values and scales, packed with ``bias``
    for :func:`w8a8_linear`. A ValueError where FBGEMM is missing or the weight is not on the
    CPU."""
    check_w8a8(weight)
    return pack_w8a8(quantize_int8(weight), bias)


def check_w8a8(weight: Tensor) -> None:
    """A ValueError unless this PyTorch can pack ``weight`` for w8a8 (FBGEMM, on the CPU)."""
    if not w8a8_available():
        raise ValueError(
            "weights='w8a8' needs PyTorch's FBGEMM quantised linear (x86 CPU builds); this "
            f"build's quantised engines are {torch.backends.quantized.supported_engines}"
        )
    if isinstance(weight, Tensor) and weight.device.type != "cpu":
        raise ValueError(f"weights='w8a8' runs on the CPU only, got a weight on {weight.device}")


def pack_w8a8(q: Int8Weight, bias: Tensor | None = None) -> W8A8Weight:
    """The int8 weight ``q`` (and ``bias``) packed for :func:`w8a8_linear`, as they are (rows of
    an :class:`Int8Weight` from :func:`rows_of` pack to what their quantised rows would); the
    caller has checked :func:`check_w8a8`."""
    N, K = q.values.shape
    zero = torch.zeros(N, dtype=torch.long)
    with warnings.catch_warnings():  # PyTorch marks its quantised tensors deprecated (2.13)
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q.values, q.scale.double(), zero, 0)
        b = None if bias is None else bias.detach().float().contiguous()
        packed = torch.ops.quantized.linear_prepack(qw, b)
    return W8A8Weight(packed, N, K, q.nbytes)


def w8a8_linear(x: Tensor, q: W8A8Weight) -> Tensor:
    """``x @ Wᵀ + bias`` for x (..., K) with W (and its bias) held as ``q``, one row at a time
    (see the module's notes); the result in x's dtype."""
    K = q.in_features
    if x.shape[-1] != K:
        raise ValueError(f"x must end in the weight's {K} input features, got {tuple(x.shape)}")
    rows = x.reshape(-1, K).float()  # (M, K)
    # reduce_range=True: 7-bit inputs, so that AVX2's pairwise u8·s8 sums cannot saturate int16
    if rows.shape[0] == 1:  # decoding one sequence: one call, nothing to join
        out = torch.ops.quantized.linear_dynamic(rows, q.packed, True)
    elif rows.shape[0]:
        out = torch.cat(
            [torch.ops.quantized.linear_dynamic(r, q.packed, True) for r in rows.split(1)]
        )
    else:
        out = rows.new_empty(0, q.out_features)
    return out.to(x.dtype).view(*x.shape[:-1], q.out_features)
