"""What decoding one token reads, and how fast this machine reads memory.

Decoding one token multiplies one row by every weight matrix and attends over the keys and
values of every position before it: it reads each weight once and the KV cache once, so its
speed is bounded by read bandwidth / bytes per token. :func:`weight_bytes` and :func:`kv_bytes`
count those bytes from a model's own tensors; :func:`read_bandwidth` times a sum over a large
fp32 buffer, the simplest kernel that does nothing but read (``dikkat bench decode`` reports
the share of it that decoding reaches; docs/models.md, "Measuring speed").

Notation: ``G`` key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from dikkat.layers.moe import SparseMoE
from dikkat.validate import check_int
from dikkat.weights.dense import Bf16Linear, Fp32Linear, Int8Linear
from dikkat.weights.held import InferenceLinear

__all__ = [
    "available_bytes",
    "expert_picks",
    "kv_bytes",
    "mean_kv_bytes",
    "peak_rss_mb",
    "read_bandwidth",
    "weight_bytes",
]


def _read_by(m: InferenceLinear) -> list[Tensor]:
    """The tensors a product of ``m`` reads: those of its format's layer in
    :mod:`dikkat.weights.dense`, or, for another layer, every tensor it holds."""
    bias = [] if m.bias is None else [m.bias]
    if isinstance(m, Int8Linear):  # W8A8Linear too: FBGEMM packs the same values and scales
        return [m._q.values, m._q.scale, *bias]
    if isinstance(m, Bf16Linear):
        return [m._w16] if m._b16 is None else [m._w16, m._b16]
    if isinstance(m, Fp32Linear):
        return [m.weight, *bias]
    return _own(m) + [v for v in vars(m).values() if isinstance(v, Tensor)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors one decoded token reads: every linear layer's weight in its
    format (an :class:`InferenceLinear`'s ``nbytes`` where it states one), every other
    parameter and buffer whole, and one row of an embedding table. Storage shared by two
    modules (an output projection tied to the embedding) counts once, as the projection's. Of a
    mixture of experts (:class:`~dikkat.layers.SparseMoE`), a token reads the router and the k
    experts it picks: k times one expert's bytes (the experts may be views of one stack)."""
    mixtures = [m for m in model.modules() if isinstance(m, SparseMoE)]
    inside = {id(e) for moe in mixtures for e in moe.experts.modules()}
    inside |= {id(moe.stacked) for moe in mixtures}  # held again by the experts' views
    modules = [m for m in model.modules() if id(m) not in inside]
    seen: set[int] = set()
    total = _counted(modules, seen)
    for moe in mixtures:
        total += moe.top_k * _counted(list(moe.experts[0].modules()), set())
    for m in modules:  # last: a table an output projection reads whole was counted there
        if isinstance(m, nn.Embedding) and _fresh(m.weight, seen):
            total += m.weight.shape[1] * m.weight.element_size()
    return total


def _fresh(t: Tensor, seen: set[int]) -> bool:
    """Whether ``t``'s storage is not in ``seen`` yet (and note it there)."""
    key = t.untyped_storage().data_ptr()
    fresh = key not in seen
    seen.add(key)
    return fresh


def _counted(modules: list[nn.Module], seen: set[int]) -> int:
    """Bytes of ``modules``' weights (see :func:`weight_bytes`), storages in ``seen`` left out."""

    def size(t: Tensor) -> int:
        return t.numel() * t.element_size()

    total = 0
    for m in modules:
        if isinstance(m, nn.Embedding):
            continue
        if isinstance(m, InferenceLinear):
            read = _read_by(m)
            fresh = [t for t in read if _fresh(t, seen)]
            stated = getattr(m, "nbytes", None)  # the layer's own count, where it keeps one
            if isinstance(stated, int):
                total += stated if fresh or not read else 0
            else:
                total += sum(size(t) for t in fresh)
        else:
            total += sum(size(t) for t in _own(m) if _fresh(t, seen))
    return total


def expert_picks(model: nn.Module) -> tuple[int, int] | None:
    """(k, E) of a model whose blocks are mixtures of experts — the experts a token reads of
    those a layer holds — and None for a model without one."""
    for m in model.modules():
        if isinstance(m, SparseMoE):
            return m.top_k, m.n_experts
    return None


def _own(m: nn.Module) -> list[Tensor]:
    return [*m.parameters(recurse=False), *m.buffers(recurse=False)]


def kv_bytes(model: nn.Module, keys: int) -> int:
    """Bytes of the KV cache one decoded token reads when it attends over ``keys`` positions
    (its own included): keys and values, 2 · G · D per position and layer, in the cache's dtype;
    a sliding layer reads its window at most."""
    check_int("keys", keys)
    layout = model.cache_layout()  # type: ignore[operator]
    per_position = 2 * layout.kv_heads * layout.head_dim * layout.dtype.itemsize
    blocks = getattr(model, "blocks", ())
    windows = [getattr(b, "window", None) for b in blocks]
    if len(windows) != layout.n_layers:
        windows = [None] * layout.n_layers
    return per_position * sum(keys if w is None else min(keys, w) for w in windows)


def mean_kv_bytes(model: nn.Module, prompt_tokens: int, new_tokens: int) -> float:
    """:func:`kv_bytes` averaged over the timed steps of a decode: step i (from 0) feeds new
    token i at position prompt_tokens + i and attends over prompt_tokens + i + 1 keys."""
    steps = range(new_tokens - 1)
    return statistics.fmean(kv_bytes(model, prompt_tokens + i + 1) for i in steps)


def read_bandwidth(nbytes: int, repeats: int = 3) -> float:
    """10⁹ bytes per second that summing an fp32 buffer of ``nbytes`` reads, best of
    ``repeats``, with torch's current threads."""
    check_int("nbytes", nbytes, at_least=4)
    check_int("repeats", repeats)
    buffer = torch.ones(nbytes // 4)  # written once: every page is resident before the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def available_bytes() -> int | None:
    """The memory Linux can give without swapping (``MemAvailable``); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def peak_rss_mb() -> float | None:
    """This process's peak resident memory so far, in 10⁶ bytes; None where unknown.

    On Linux it is ``VmHWM`` of ``/proc/self/status``, the high-water mark of this program's
    own memory (:func:`dikkat.bench.timing.peak_memory` resets it: after that, the peak since).
    ``getrusage``'s ``ru_maxrss`` serves elsewhere; on Linux it survives ``execve`` (getrusage(2),
    NOTES), so a program that a large process starts (a benchmark script running ``dikkat bench
    decode``) would report at least that process's resident size.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # reported in kB
    except OSError:
        pass
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e6  # bytes on macOS, else KiB
