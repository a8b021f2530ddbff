"""Attention backends side by side: forward time and peak extra memory against n.

Shapes: ``B`` batch, ``H`` heads, ``n`` tokens (queries = keys), ``D`` head dim; q, k, v are
(B, H, n, D) from ``torch.randn``.

Backends, each in every (dtype, mask, n) group of one run:

- ``sdpa`` — PyTorch's ``F.scaled_dot_product_attention`` called directly: no mask, ``is_causal``,
  or, for a structured mask, the equivalent dense (1, 1, n, n) bool mask built before timing (its
  bytes are reported, not counted as extra memory: the caller holds it like q, k, v). Every ratio
  in the table is against this row.
- ``reference``, ``tiled``, ``auto``, ``linear``, ``flex`` — ``dikkat.attention(..., backend=…)``.
  ``flex`` (compiled FlexAttention) only where this dikkat registers it; its first call compiles,
  and that compile time is reported apart from the steady-state time. ``linear`` is another model
  (no mask or causal only), listed for its cost.

Masks: ``none``, ``causal``, ``window<W>`` (causal sliding window of W keys), ``documents<K>``
(K equal packed documents, causal within each), ``doclen<L>`` (packed documents of L tokens each,
causal within each: ``doclen1024`` is 16 documents in 16384 tokens, and its cost grows linearly
in n, where a fixed number of documents grows quadratically). A row whose estimated extra
memory exceeds the budget is skipped with a note instead of risking the machine.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import dikkat
from dikkat import masks
from dikkat.bench.record import save_json
from dikkat.bench.report import (
    format_header,
    format_row,
    format_skip,
    format_summary,
    growth_ratios,
    headlines,
)
from dikkat.bench.timing import peak_memory, timeit
from dikkat.core.masks import Mask
from dikkat.validate import check_int

__all__ = [
    "BACKENDS",
    "DTYPES",
    "QUICK",
    "AttentionBenchConfig",
    "build_mask",
    "dense_mask",
    "estimate_extra_bytes",
    "parse_mask",
    "run_attention_benchmark",
    "save_results",
    "visible_cells",
]

BACKENDS = ("sdpa", "reference", "tiled", "auto", "linear", "flex")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MASK = re.compile(r"none|causal|window([1-9]\d*)|documents([1-9]\d*)|doclen([1-9]\d*)")
_GiB = 2**30


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What one run measures."""

    sizes: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)  # n
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    masks: tuple[str, ...] = ("none", "causal", "window256", "doclen1024")
    backends: tuple[str, ...] = BACKENDS
    B: int = 1
    H: int = 8
    D: int = 64
    min_time: float = 0.3  # seconds of timed calls per row (at least one call after the first)
    max_bytes: int = 8 * _GiB  # skip a row whose estimated extra memory exceeds this
    reference_max_n: int = 4096  # the reference holds B·H·n² scores three times over
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sizes", "dtypes", "masks", "backends"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty: nothing to measure")
        if any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes must be positive, got {list(self.sizes)}")
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend {unknown[0]!r}; choose from {', '.join(BACKENDS)}")
        for name in self.masks:
            parse_mask(name)


def parse_mask(name: str) -> tuple[str, int]:
    """``"window256"`` → ``("window", 256)``; ``"none"`` and ``"causal"`` carry 0."""
    match = _MASK.fullmatch(name)
    if match is None:
        raise ValueError(
            f"unknown mask {name!r}; use none, causal, window<W> (e.g. window256), "
            "documents<K> (e.g. documents16) or doclen<L> (e.g. doclen1024)"
        )
    if match.group(1):
        return "window", int(match.group(1))
    if match.group(2):
        return "documents", int(match.group(2))
    if match.group(3):
        return "doclen", int(match.group(3))
    return name, 0


# a smoke run: every backend but flex (its compile alone takes longer than the whole run)
QUICK = AttentionBenchConfig(
    sizes=(128, 256), dtypes=("fp32",), backends=BACKENDS[:-1], min_time=0.02
)


def document_ids(n: int, documents: int) -> Tensor:
    """(n,) document id of each position: ``documents`` equal runs (±1 token when uneven)."""
    return torch.arange(n) * documents // n


def _ids(kind: str, size: int, n: int) -> Tensor:
    """Document ids of a ``documents<K>`` or ``doclen<L>`` mask over n tokens."""
    return document_ids(n, size) if kind == "documents" else torch.arange(n) // size


def build_mask(name: str, n: int) -> Mask | None:
    """The dikkat mask called ``name`` over n tokens (None for ``"none"``)."""
    kind, size = parse_mask(name)
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(size)
    return masks.document(_ids(kind, size, n))


def visible_cells(name: str, n: int) -> int:
    """How many of the n × n score cells the mask lets through (per head)."""
    kind, size = parse_mask(name)
    if kind == "none":
        return n * n
    if kind == "causal":
        return n * (n + 1) // 2
    if kind == "window":  # row i sees min(i + 1, W) keys
        w = min(size, n)
        return w * (w + 1) // 2 + (n - w) * w
    lengths = torch.bincount(_ids(kind, size, n)).tolist()
    return sum(length * (length + 1) // 2 for length in lengths)


def dense_mask(mask: Mask, n: int, rows: int = 1024) -> Tensor:
    """``mask.materialize(1, 1, n, n)`` (the bool mask SDPA is given), built ``rows`` rows at a
    time so that the predicate's intermediate (n, n) grids (an int64 distance for a window) are
    never whole."""
    check_int("n", n, at_least=0)
    check_int("rows", rows)
    out = torch.empty(1, 1, n, n, dtype=torch.bool)
    one, keys = torch.arange(1), torch.arange(n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out[:, :, r0:r1] = mask.evaluate(one, one, torch.arange(r0, r1), keys)
    return out


def estimate_extra_bytes(
    backend: str, mask: str, n: int, dtype_bytes: int, B: int, H: int, D: int
) -> int:
    """A generous estimate of the memory one call needs beyond its inputs (``auto``: pass the
    backend it picks). Calibrated on measured peaks; it guards the machine, nothing more."""
    structured = mask not in ("none", "causal")
    rows = B * H * n * D * 4  # one fp32 (B, H, n, D) tensor
    # what a call can add besides its tensors: the math libraries' scratch space, a thread's
    # first allocations (peaks measured in a test process have run over the tensors alone)
    slack = 8 * 2**20
    if backend == "reference":  # scores, masked copy, weights and temporaries; the mask's grid
        return 6 * B * H * n * n * dtype_bytes + (12 * n * n if mask != "none" else 0) + slack
    if backend == "sdpa" and structured:  # the bool mask, SDPA's float copy, a band to build it
        return n * n * (1 + dtype_bytes) + 12 * 1024 * n + slack
    return 8 * rows + 64 * 2**20  # O(n): a few (B, H, n, D) fp32 tensors and the tiles


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _budget(config: AttentionBenchConfig) -> int:
    """The config's limit, and never more than 60 % of the memory the system has free now."""
    available = _available_bytes()
    return config.max_bytes if available is None else min(config.max_bytes, int(0.6 * available))


def _measure(fn: Callable[[], object], min_time: float) -> tuple[float, float, int | None]:
    """(first call s, median s of the calls after it, peak extra bytes of one more call).

    Memory is measured on a call of its own: while measuring, every large block is a fresh
    mmap (see :mod:`dikkat.bench.timing`), which would slow the timed calls."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    seconds = timeit(fn, min_time=min_time, warmup=0)
    return first, seconds, peak_memory(fn)


def _caller(
    backend: str, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, dense: Tensor | None
) -> Callable[[], Tensor]:
    """One forward call of ``backend``; sdpa is PyTorch's own function, given ``dense`` if set."""
    if backend != "sdpa":
        return lambda: dikkat.attention(q, k, v, mask, backend=backend)  # type: ignore[return-value]
    if dense is not None:
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None)


@dataclass
class _Run:
    """Rows and skips of a run in progress, printed as they come."""

    config: AttentionBenchConfig
    log: Callable[[str], None]
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def skip(self, dtype: str, mask: str, n: int, backend: str, why: str) -> None:
        self.skipped.append({"dtype": dtype, "mask": mask, "n": n, "backend": backend, "why": why})
        self.log(format_skip(self.skipped[-1]))

    def refusal(self, backend: str, chose: str | None, mask: str, n: int, elem: int) -> str | None:
        """Why ``backend`` is not run on this (mask, n), or None to run it."""
        config = self.config
        if backend == "flex" and "flex" not in dikkat.available_backends():
            return "no 'flex' backend registered in this dikkat"
        if backend == "linear" and mask not in ("none", "causal"):
            return "another model: no mask or causal only"
        if backend == "reference" and n > config.reference_max_n:
            return f"n > {config.reference_max_n} (--reference-max-n)"
        need = estimate_extra_bytes(chose or backend, mask, n, elem, config.B, config.H, config.D)
        budget = _budget(config)
        if need > budget:
            return (
                f"needs ≈ {need / _GiB:.1f} GiB, over the {budget / _GiB:.1f} GiB budget "
                "(--max-gib, or 60 % of free memory)"
            )
        return None

    def group(self, dtype_name: str, mask_name: str, n: int, gen: torch.Generator) -> None:
        """Every backend on one (dtype, mask, n), sdpa first."""
        config, B, H, D = self.config, self.config.B, self.config.H, self.config.D
        dtype = DTYPES[dtype_name]
        elem = torch.empty((), dtype=dtype).element_size()
        mask = build_mask(mask_name, n)
        structured = mask_name not in ("none", "causal")
        q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dtype) for _ in range(3))
        sdpa_seconds: float | None = None
        for backend in (b for b in BACKENDS if b in config.backends):
            where = (dtype_name, mask_name, n, backend)
            chose = dikkat.explain(q, k, v, mask).split(" ", 1)[0] if backend == "auto" else None
            why = self.refusal(backend, chose, mask_name, n, elem)
            if why is not None:
                self.skip(*where, why)
                continue
            dense = dense_mask(mask, n) if backend == "sdpa" and structured else None
            try:
                with torch.no_grad():
                    first, seconds, peak = _measure(
                        _caller(backend, q, k, v, mask, dense), config.min_time
                    )
            except (ValueError, RuntimeError, NotImplementedError) as e:
                self.skip(*where, f"failed: {(str(e).splitlines() or [repr(e)])[0]}")
                continue
            mask_bytes = 0 if dense is None else dense.nbytes
            del dense  # 1 GiB at n = 32768: not to be held while the others run
            if backend == "sdpa":
                sdpa_seconds = seconds
            row = {
                "dtype": dtype_name,
                "mask": mask_name,
                "n": n,
                "backend": backend,
                "seconds": seconds,
                "first_call_seconds": first,
                "compile_seconds": max(0.0, first - seconds) if backend == "flex" else None,
                "gflops": None
                if backend == "linear"  # another model: softmax FLOPs mean nothing for it
                else 4.0 * B * H * D * visible_cells(mask_name, n) / seconds / 1e9,
                # the output is (B, H, n, D) like q
                "peak_extra_bytes": None if peak is None else max(0, peak - q.nbytes),
                "vs_sdpa": None if sdpa_seconds is None else seconds / sdpa_seconds,
                "chose": chose,
                "mask_bytes": mask_bytes,
            }
            self.rows.append(row)
            self.log(format_row(row))


def run_attention_benchmark(
    config: AttentionBenchConfig | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Measure every (dtype, mask, n, backend) of ``config``; print the table through ``log``.

    Returns ``{"config", "B", "H", "D", "rows", "skipped", "growth", "headlines"}``. A row holds
    dtype, mask, n, backend, seconds (median), first_call_seconds, compile_seconds (flex only),
    gflops (useful softmax FLOPs over the visible cells; None for linear), peak_extra_bytes
    (the peak during the calls minus the resident memory before, minus the output; None where
    unmeasurable), vs_sdpa, chose (auto's pick) and mask_bytes (sdpa's dense mask).
    """
    config = config or AttentionBenchConfig()
    run = _Run(config, log)
    gen = torch.Generator().manual_seed(config.seed)
    for line in format_header(config.B, config.H, config.D):
        log(line)
    for dtype_name in config.dtypes:
        for mask_name in config.masks:
            for n in config.sizes:
                run.group(dtype_name, mask_name, n, gen)
    growth = growth_ratios(run.rows)
    result = {
        "config": asdict(config),
        "B": config.B,
        "H": config.H,
        "D": config.D,
        "rows": run.rows,
        "skipped": run.skipped,
        "growth": growth,
        "headlines": headlines(run.rows, growth),
    }
    for line in format_summary(result):
        log(line)
    return result


def save_results(result: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``attention.json`` (and, with ``plots``, ``attention_time.png`` and
    ``attention_memory.png``) into ``out_dir``, each atomically; returns the paths."""
    out_dir = Path(out_dir)
    paths = [save_json(out_dir / "attention.json", result)]
    if plots and result["rows"]:
        from dikkat.bench.plot import plot_attention

        paths += plot_attention(result, out_dir)
    return paths
