"""The cost claim of docs/contract.md §6 as numbers: what the n × n score matrix of attention
weighs.

Each head scores every query against every key, so one head holds n² score cells, and softmax
attention written out (the reference) keeps them all: at n = 32768 that is 4 GiB per head in fp32,
32 GiB for 8 heads, beside q, k and v of 3·n·D values per head (24 MiB). Tiled attention
(docs/contract.md §16) never holds the matrix; per head it keeps an fp32 output accumulator of n·D
values and the log-sum-exp of each row (n values), and at any time one tile of at most
``tile_cells`` scores (its mask, in fp32 at most) for all heads together: O(n·D + tile).

Shapes: ``B`` batch, ``H`` heads, ``n`` tokens (queries = keys), ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from dikkat.core.tiled import CELLS

__all__ = ["DEFAULT_NS", "AttentionCost", "attention_cost", "format_bytes", "format_cost_table"]

DEFAULT_NS = (1024, 4096, 32768, 131072)
_FP32 = 4  # bytes: tiled attention keeps its statistics and accumulator in fp32


@dataclass(frozen=True)
class AttentionCost:
    """Sizes of one self-attention call over n tokens (bytes at ``dtype_bytes`` per value)."""

    n: int  # tokens; queries and keys alike
    H: int  # heads
    D: int  # head dim
    dtype_bytes: int  # 4 = fp32, 2 = bf16
    B: int = 1  # batch
    tile_cells: int = CELLS  # score cells of one tiled tile, all heads

    @property
    def score_cells_per_head(self) -> int:
        """n²: one score per (query, key)."""
        return self.n * self.n

    @property
    def score_cells(self) -> int:
        """B·H·n²: every head of every sequence."""
        return self.B * self.H * self.score_cells_per_head

    @property
    def score_bytes_per_head(self) -> int:
        return self.score_cells_per_head * self.dtype_bytes

    @property
    def score_bytes(self) -> int:
        """The full (B, H, n, n) score matrix, as the reference holds it."""
        return self.score_cells * self.dtype_bytes

    @property
    def qkv_bytes(self) -> int:
        """q, k and v, each (B, H, n, D)."""
        return 3 * self.B * self.H * self.n * self.D * self.dtype_bytes

    @property
    def tiled_bytes(self) -> int:
        """What tiled attention holds instead of the scores: per head an fp32 accumulator (n·D)
        and log-sum-exp (n), and one tile of scores for all heads."""
        per_head = self.n * self.D + self.n
        return (self.B * self.H * per_head + self.tile_cells) * _FP32


def attention_cost(
    n: int,
    H: int = 8,
    D: int = 64,
    dtype_bytes: int = 4,
    *,
    B: int = 1,
    tile_cells: int = CELLS,
) -> AttentionCost:
    """The sizes of self-attention over ``n`` tokens with ``H`` heads of dim ``D``."""
    for name, value in (("n", n), ("H", H), ("D", D), ("dtype_bytes", dtype_bytes), ("B", B)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tile_cells < 1:
        raise ValueError(f"tile_cells must be a positive integer, got {tile_cells!r}")
    return AttentionCost(n=n, H=H, D=D, dtype_bytes=dtype_bytes, B=B, tile_cells=tile_cells)


def format_bytes(n: int) -> str:
    """Binary units: 1536 → '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _count(n: int) -> str:
    """Cell counts as powers of two where they are (2^20 = 1 Mi), else with separators."""
    for unit, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size:,} {unit}"
    return f"{n:,}"


def format_cost_table(
    ns: tuple[int, ...] = DEFAULT_NS,
    H: int = 8,
    D: int = 64,
    B: int = 1,
    tile_cells: int = CELLS,
) -> str:
    """The cost table for each n: score cells and bytes (fp32, bf16), q/k/v bytes, tiled's."""
    heads = f"{H} heads" if B == 1 else f"{B}×{H} heads"
    header = (
        f"{'n':>7}  {'cells/head':>10}  {'fp32/head':>10}  {f'fp32 {heads}':>13}  "
        f"{'bf16/head':>10}  {f'bf16 {heads}':>13}  {'q,k,v fp32':>10}  {'tiled fp32':>10}"
    )
    lines = [
        f"attention cost, B={B}, H={H}, D={D}: the score matrix against what tiled attention "
        f"holds (tiles of {tile_cells:,} cells)",
        header,
    ]
    for n in ns:
        fp32 = attention_cost(n, H, D, 4, B=B, tile_cells=tile_cells)
        bf16 = attention_cost(n, H, D, 2, B=B, tile_cells=tile_cells)
        lines.append(
            f"{n:>7,}  {_count(fp32.score_cells_per_head):>10}  "
            f"{format_bytes(fp32.score_bytes_per_head):>10}  {format_bytes(fp32.score_bytes):>13}  "
            f"{format_bytes(bf16.score_bytes_per_head):>10}  {format_bytes(bf16.score_bytes):>13}  "
            f"{format_bytes(fp32.qkv_bytes):>10}  {format_bytes(fp32.tiled_bytes):>10}"
        )
    lines += [
        "cells/head: n² scores.  fp32/bf16: the (B, H, n, n) score matrix the plain formula holds.",
        "tiled: per head an fp32 accumulator n·D and log-sum-exp n; one tile for all heads.",
    ]
    return "\n".join(lines)
