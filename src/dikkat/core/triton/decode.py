"""Decoding attention in Triton: a few queries against a long key/value cache (flash-decoding).

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (G divides H), ``T`` query
length (≤ 16 here), ``S`` key length, ``D`` query/key head dim, ``Dv`` value head dim.

With one query per head there is too little work per (batch, head) to fill a GPU if each
program walks all S keys. Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context
inference", crfm.stanford.edu/2023/10/12/flashdecoding.html) splits the keys into chunks, runs
one program per chunk, and merges the chunks' partial outputs by their log-sum-exps:
``out = Σ_c exp(lse_c − lse) · out_c`` with ``lse = log Σ_c exp(lse_c)``. The kernels are in
:mod:`dikkat.core.triton.decode_kernels`.

What it does differently from the reference (``dikkat.core.reference``): scores and the softmax
in fp32 whatever the input dtype (on CUDA, fp32 inputs multiply in full fp32, not TF32); the
weights are rounded to v's dtype before ``P·V``, as FlashAttention does; the key order of the
sums differs. Forward only: decoding needs no backward, and :func:`triton_decode` refuses inputs
that would need one. Non-finite inputs are computed as they come (a NaN value row that a mask
hides can still reach the output through ``0 · NaN``); ``dikkat.attention`` applies its NaN
rule around a backend, not this function.

Masks: the host asks the mask for the key range its queries may see (:meth:`Mask.kv_range`), and
only keys in that range are split and loaded. Unless the mask is known to allow every key of the
range (:meth:`Mask.kv_full_range`), it is evaluated there into a dense bool of shape
(B | 1, H | 1, T, range) — small, as T ≤ 16 — which the kernel loads beside each key block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dikkat.core.checks import AttentionShape, broadcast_kv, check_mask, check_qkv, check_scale
from dikkat.core.masks import Mask

__all__ = ["MAX_HEAD_DIM", "MAX_QUERIES", "MAX_SPLITS", "triton_decode"]

MAX_QUERIES = 16  # the most queries per head: beyond, a prefill kernel tiles the queries better
MAX_HEAD_DIM = 256  # D and Dv; each is padded to the next power of 2 (at least 16) in-kernel
MAX_SPLITS = 64  # the merge kernel holds every chunk of a row at once

# How many chunks split=None asks for. These are rules of thumb, not measured: at least two
# programs per streaming multiprocessor, so that one waiting on memory has a neighbour to run,
# and at least MIN_CHUNK keys per chunk, so that the merge stays a small fraction of the work.
PROGRAMS_PER_SM = 2
MIN_CHUNK = 256
INTERPRETER_SLOTS = 8  # under Triton's interpreter (no SMs): a fixed count of program slots

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float,
    q_offset: int = 0,
    split: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of T ≤ 16 queries against S keys, the keys split across programs.

    Args:
        q: queries (B, H, T, D), fp16, bf16 or fp32, 1 ≤ T ≤ 16, D ≤ 256.
        k: keys (B, G, S, D) (or batch size 1, shared by the batch); any strides, so a view
            into a longer preallocated cache is read in place.
        v: values (B, G, S, Dv), Dv ≤ 256.
        mask: a :mod:`dikkat.masks` mask or a bool tensor broadcastable to (B, H, T, S);
            True = may attend.
        scale: multiplies the scores (1/√D for the usual attention).
        q_offset: absolute position of the first query among the keys: query i sits at
            position ``q_offset + i`` (S − T for a decoding step, where causal lets query i see
            keys 0 … q_offset + i).
        split: how many chunks to cut the visible key range into (fewer when it holds fewer
            keys; at most :data:`MAX_SPLITS`). None: enough chunks for ``PROGRAMS_PER_SM``
            programs per streaming multiprocessor of the GPU (``INTERPRETER_SLOTS`` program
            slots under the interpreter), each of at least ``MIN_CHUNK`` keys.

    Returns:
        ``(out, lse)``: out (B, H, T, Dv) in q's dtype, lse (B, H, T) fp32, the natural
        log-sum-exp of each row's scaled scores. A row with no visible key gives out 0 and lse
        −inf.

    Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
    set before triton is imported). Forward only: raises ``ValueError`` when autograd would
    need a backward (grad mode on and q, k or v requiring grad).
    """
    shape = check_qkv(q, k, v)
    _check_decode(q, k, v, shape)
    checked = check_mask(mask, shape, q_offset)
    scale = check_scale(scale, shape.D)
    n_split = _check_split(split)
    kernels = _kernels()
    _check_device(q, kernels.INTERPRETED)

    B, H, T, S, Dv = shape.B, shape.H, shape.T, shape.S, shape.Dv
    k, v = broadcast_kv(k, B), broadcast_kv(v, B)  # (B, G, S, ·) views
    lo, hi = (0, S) if checked is None else checked.kv_range(q_offset, q_offset + T, S)
    lo, hi = max(0, lo), min(S, hi)
    out = torch.zeros(B, H, T, Dv, dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, T), -math.inf, dtype=torch.float32, device=q.device)
    if hi <= lo or out.numel() == 0:
        return out, lse  # no query sees any key
    allowed = _allowed(checked, shape, q_offset, lo, hi, q.device)

    block_d, block_dv = _block(shape.D), _block(Dv)
    wide = max(block_d, block_dv) > 128  # then fewer rows and keys per block, to fit in registers
    block_n = 32 if wide else 64
    rows = shape.group * T  # the query rows of one key/value head
    block_m = max(16, min(_next_power_of_2(rows), 32 if wide else 64))
    row_blocks = -(-rows // block_m)
    chunk, n_split = _chunks(hi - lo, n_split, B * shape.G * row_blocks, block_n, q.device)

    out_part = torch.empty(B, H, T, n_split, Dv, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, T, n_split, dtype=torch.float32, device=q.device)
    # a 1-byte view of the bool mask (expanded dims keep stride 0); a dummy pointer without one
    a = allowed.view(torch.uint8) if allowed is not None else lse_part
    a_strides = allowed.stride() if allowed is not None else (0, 0, 0, 0)
    kernels.split_kernel[(B * shape.G, n_split, row_blocks)](
        q,
        k,
        v,
        a,
        out_part,
        lse_part,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *a_strides,
        out_part.stride(0),
        out_part.stride(1),
        out_part.stride(2),
        out_part.stride(3),
        *lse_part.stride(),
        scale * math.log2(math.e),
        shape.G,
        T,
        shape.group,
        shape.D,
        Dv,
        lo,
        hi,
        chunk,
        HAS_MASK=allowed is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        # fp32 inputs multiply in fp32 (Triton's default there is TF32); others ignore it
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    kernels.merge_kernel[(B * H * T,)](
        out_part,
        lse_part,
        out,
        lse,
        n_split,
        Dv,
        BLOCK_S=max(2, _next_power_of_2(n_split)),
        BLOCK_DV=block_dv,
        num_warps=4,
    )
    return out, lse


def _kernels():
    """The kernel module, imported on first use: triton is an optional heavy dependency (it
    comes with CUDA builds of torch), so ``import dikkat`` must not need it."""
    try:
        from dikkat.core.triton import decode_kernels
    except ImportError as e:
        raise ImportError(
            f"triton_decode needs triton ({e}); CUDA builds of torch install it, or pip install "
            f"triton"
        ) from e
    return decode_kernels


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block(d: int) -> int:
    """A head dim padded to a power of 2, at least 16 (``tl.dot``'s smallest inner size)."""
    return max(16, _next_power_of_2(d))


def _check_decode(q: Tensor, k: Tensor, v: Tensor, shape: AttentionShape) -> None:
    if q.dtype not in _DTYPES:
        raise TypeError(f"triton_decode takes fp16, bf16 or fp32 tensors, got dtype {q.dtype}")
    if not 1 <= shape.T <= MAX_QUERIES:
        raise ValueError(
            f"triton_decode takes 1 to {MAX_QUERIES} queries per head (a decoding step), got "
            f"T = {shape.T}: q {tuple(q.shape)}"
        )
    for name, dim in (("D", shape.D), ("Dv", shape.Dv)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"triton_decode takes head dims up to {MAX_HEAD_DIM}, got {name} = {dim}: "
                f"q {tuple(q.shape)}, v {tuple(v.shape)}"
            )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        needing = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
        raise ValueError(
            f"triton_decode is forward only (decoding needs no backward), but {', '.join(needing)} "
            f"requires grad with grad mode on; call it under torch.no_grad() or "
            f"torch.inference_mode(), or use dikkat.attention for training"
        )


def _check_split(split: int | None) -> int | None:
    if split is None:
        return None
    if isinstance(split, bool) or not isinstance(split, int):
        raise TypeError(f"split must be an int or None, got {type(split).__name__}")
    if not 1 <= split <= MAX_SPLITS:
        raise ValueError(f"split must be between 1 and {MAX_SPLITS} (or None), got {split}")
    return split


def _check_device(q: Tensor, interpreted: bool) -> None:
    if q.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"triton_decode runs on CUDA tensors (or on CPU under Triton's interpreter, "
            f"TRITON_INTERPRET=1 set before triton is imported), got tensors on {q.device}"
        )
    if q.device.type == "cuda" and interpreted:
        raise ValueError(
            "triton_decode's kernels were loaded under Triton's interpreter (TRITON_INTERPRET=1), "
            "which runs on CPU tensors only, got tensors on cuda"
        )


def _allowed(
    mask: Mask | None, shape: AttentionShape, q_offset: int, lo: int, hi: int, device: torch.device
) -> Tensor | None:
    """The mask over keys lo … hi − 1 as a (B, H, T, hi − lo) bool view (broadcast dims of
    stride 0), or None when every query may see every key there."""
    if mask is None:
        return None
    full_lo, full_hi = mask.kv_full_range(q_offset, q_offset + shape.T, shape.S)
    if full_lo <= lo and hi <= full_hi:
        return None
    allowed = mask.evaluate(
        torch.arange(shape.B, device=device),
        torch.arange(shape.H, device=device),
        torch.arange(q_offset, q_offset + shape.T, device=device),
        torch.arange(lo, hi, device=device),
    )  # (B | 1, H | 1, T | 1, hi − lo)
    return allowed.to(device=device, dtype=torch.bool).expand(shape.B, shape.H, shape.T, hi - lo)


def _chunks(
    keys: int, split: int | None, programs: int, block_n: int, device: torch.device
) -> tuple[int, int]:
    """(keys per chunk, number of chunks) for ``keys`` visible keys; ``programs`` is how many
    programs each chunk launches."""
    if split is None:
        slots = INTERPRETER_SLOTS
        if device.type == "cuda":
            slots = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        wanted = -(-slots // programs)
        split = max(1, min(wanted, -(-keys // MIN_CHUNK), MAX_SPLITS))
        chunk = -(-keys // split)
        chunk = -(-chunk // block_n) * block_n  # whole key blocks per chunk
    else:
        chunk = -(-keys // min(split, keys))
    return chunk, -(-keys // chunk)
