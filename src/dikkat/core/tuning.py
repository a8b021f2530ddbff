"""Numbers the backends' choices rest on that depend on the machine, keyed by device type.

Notation: ``B`` batch, ``H`` query heads, ``T``/``S`` query/key length; a *cell* is one score
(one query, one key).

Each value says where, when and how it was found, and the command that measures it again. Only
the CPU entries were measured; a device type with no measurement gets :data:`DEFAULT`, whose
values are reasoned guesses, marked as such, not CPU figures carried over. The measurements
themselves are written up, with the machines, in ``docs/attention.md`` ("Measured constants").

``python -m dikkat.core.measure`` measures the tiled backend's kernel speed by rows per block on
this machine (the first entry below); the others are re-measured with ``dikkat bench attention``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["CPU", "CUDA", "DEFAULT", "TABLE", "Tuning", "for_device"]


@dataclass(frozen=True)
class Tuning:
    """The machine-dependent constants of one device type (see the entries for their origin)."""

    # tiled, windows plans: the tile kernel's speed by query rows per block, relative to 128
    # rows; the plan takes the block size with the least computed cells over this speed
    rows_speed: Mapping[int, float]
    # auto passes SDPA by (for tiled) when a call has at least this many cells per batch entry
    # and head (T·S) ...
    sdpa_avoid_min_cells: int
    # ... and its mask leaves at most this fraction of them visible (tiled skips the rest)
    sdpa_avoid_max_visible: float
    # flex runs eagerly, never compiled, for calls of at most this many cells (B·H·T·S)
    flex_eager_max_cells: int
    # auto may compile flex itself for calls of at least this many cells per batch entry and
    # head (T·S); None: auto takes flex only once a call with backend="flex" compiled it
    flex_auto_compile_min_cells: int | None
    # causal linear attention: keys summed among themselves per chunk (C × C) ...
    linear_chunk: int
    # ... and rows per pass, so the working set stays small
    linear_segment: int
    # in an fp32 inference copy, a product of at most this many input rows (decoding
    # one or two sequences) multiplies the plain weight (MKL's GEMV) instead of oneDNN's packed
    # copy, which pays off only from more rows
    plain_gemv_max_rows: int = 0


def _cpu_vendor() -> str:
    """The CPU's vendor string on Linux ("GenuineIntel", "AuthenticAMD"); "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _speeds(speeds: dict[int, float]) -> Mapping[int, float]:
    return MappingProxyType(dict(speeds))


# PyTorch's CPU kernels: the machine of BENCHMARKS.md (AMD EPYC, 2 cores, AVX-512 with
# avx512_bf16, no AMX; torch 2.13.0+cpu, 2 threads).
CPU = Tuning(
    # 2026-11-30: windows tiles of 1024 keys in `_scaled_dot_product_flash_attention_for_cpu`,
    # fp32, at 64, 128 and 256 rows per block: 83, 95 and 121 GFLOP/s (the kernel splits a call
    # into chunks of 32 rows, of 64 from 192 rows and of 256 from 768, and longer chunks run
    # faster). Re-measured end to end on 2026-12-01 on an Intel Xeon with AMX (2 cores, torch
    # 2.13.0+cpu, a loaded machine, fastest of 7): 0.86, 1.00 and 1.17–1.21. Re-measure:
    # `python -m dikkat.core.measure`.
    rows_speed=_speeds({64: 0.87, 128: 1.0, 256: 1.27}),
    # Set 2026-11-30 from SDPA (given the dense bool mask) against tiled on the structured
    # masks, n ≥ 1024. Checked 2026-12-01 on the Intel Xeon above, loaded: tiled / SDPA
    # 2.25–3.56 at n = 1024 where this rule takes tiled, 0.31–1.17 at n = 2048 — there the line
    # may lie higher; a quiet run should decide (docs/attention.md). Re-measure:
    # `dikkat bench attention --sizes 512,1024,2048 --masks window128,window256,doclen256,doclen512
    # --backends sdpa,tiled,auto --dtypes fp32 --min-time 1`.
    # Raised from 0.25 on 2026-12-01 (the Intel Xeon above, 2 threads, best of 5), once tiled's
    # runs of rows stopped masking the keys every row sees: sliding windows with 8 query and 2
    # key/value heads of 64, fp32, SDPA (dense bool mask) / tiled = 2.96, 2.83, 2.39, 2.01, 3.78
    # at 30–38 % visible (n = 2048, 4096, 8192) and 1.83, 1.47, 2.24 at 47–50 %.
    sdpa_avoid_min_cells=1 << 20,
    sdpa_avoid_max_visible=0.5,
    # Not a speed measurement: a compile took 10–45 s per signature cold and 0.2–1.3 s with
    # inductor's cache warm (2026-11-30, `dikkat bench attention --backends flex`), more than
    # any call this small, whose eager scores take ≤ 4 MiB in fp32.
    flex_eager_max_cells=1 << 20,
    # never: compiled flex ran 1.15–1.76× slower than tiled on the structured masks at
    # n = 16384 (2026-11-30, `dikkat bench attention --sizes 8192,16384 --masks
    # window256,doclen1024 --backends sdpa,tiled,flex`), so a compile cannot pay for itself
    flex_auto_compile_min_cells=None,
    # 2026-11-30: causal, n = 4096 … 32768, fp32 and bf16: with segments of 4096 rows the cost
    # per token stays flat (growth t(16k)/t(8k) 1.98 fp32, 1.99 bf16). Re-measure: `dikkat
    # bench attention --sizes 4096,8192,16384,32768 --masks causal --backends linear` (chunk
    # and segment are arguments of `linear_attention`, to sweep by hand).
    linear_chunk=64,
    linear_segment=4096,
    # 2026-12-01, the Intel Xeon with AMX above (2 threads, torch 2.13.0+cpu, a shared machine,
    # best of 5, interleaved): GPT-2-small's 49 weights (12 blocks of 2304·768, 768·768,
    # 3072·768, 768·3072, and 50257·768), fp32, F.linear on the plain weight against
    # `mkldnn._linear_pointwise` on the packed one: oneDNN / plain = 1.19 at 1 row, 1.41–1.42 at
    # 2 rows, 0.67 at 8 rows. On AMD CPUs MKL's GEMV is the slower one: oneDNN / plain = 0.62 at
    # 1 row on the AVX-512 EPYC (2026-11-30) and 0.51 on an AVX2-only EPYC (2026-12-01, 2
    # threads, the 50257·768 head: 9.6 against 18.8 ms). Re-measure: `python
    # benchmarks/generation.py` (its "packed / plain" line).
    plain_gemv_max_rows=2 if _cpu_vendor() == "GenuineIntel" else 0,
)

# Any device type without a measurement (CUDA included). Off the CPU the tiled backend runs its
# tiles in plain tensor ops, not a fused kernel, so the CPU's crossovers do not hold there.
DEFAULT = Tuning(
    # not measured: every block size as fast, so the cells computed alone decide
    rows_speed=_speeds({64: 1.0, 128: 1.0, 256: 1.0}),
    # not measured: a guess that plain-ops tiles cost up to ~10× a fused kernel per cell, so
    # tiled must skip ≥ 90 % of a large grid (4096² cells per head) to win
    sdpa_avoid_min_cells=1 << 24,
    sdpa_avoid_max_visible=0.1,
    # the CPU's bound, which is about memory (eager scores ≤ 4 MiB in fp32), not speed
    flex_eager_max_cells=1 << 20,
    flex_auto_compile_min_cells=None,  # not measured: auto never compiles
    # not measured: the chunk is a property of the algorithm (the C × C products stay small);
    # segments only bound the temporaries of one pass
    linear_chunk=64,
    linear_segment=1 << 14,
)

# CUDA: DEFAULT, but auto may compile flex for a call of 4096² cells per head or more — not
# measured: a guess that a compile of a few seconds pays for itself against a call that large
# whose mask hides most of it.
CUDA = dataclasses.replace(DEFAULT, flex_auto_compile_min_cells=1 << 24)

TABLE: Mapping[str, Tuning] = MappingProxyType({"cpu": CPU, "cuda": CUDA})


def for_device(device: torch.device | str) -> Tuning:
    """The constants for a device (by its type: ``"cpu"``, ``"cuda"``, …); :data:`DEFAULT` for a
    type with no entry in :data:`TABLE`."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return TABLE.get(kind, DEFAULT)  # asked on every product of a decoding step: no new device
