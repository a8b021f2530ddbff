"""The attention benchmark's report: its table lines, growth per doubling of n, headlines."""

from __future__ import annotations

from typing import Any

__all__ = [
    "format_header",
    "format_row",
    "format_skip",
    "format_summary",
    "growth_ratios",
    "headlines",
]


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def format_header(B: int, H: int, D: int) -> list[str]:
    """The lines above the table: what is measured, and the column names."""
    return [
        f"attention forward, B={B}, H={H}, D={D}. ms: median; peak MiB: extra memory beyond the "
        "inputs and the output; ×sdpa: time / sdpa's (for a structured mask, sdpa is given the "
        "dense bool mask)",
        f"{'dtype':<6}{'mask':<13}{'n':>6}  {'backend':<10}{'ms':>10}{'GFLOP/s':>9}"
        f"{'peak MiB':>10}{'×sdpa':>8}  note",
    ]


def format_skip(skip: dict[str, Any]) -> str:
    return (
        f"{skip['dtype']:<6}{skip['mask']:<13}{skip['n']:>6}  {skip['backend']:<10}"
        f"{'skipped':>10}  {skip['why']}"
    )


def format_row(row: dict[str, Any]) -> str:
    notes = []
    if row["mask_bytes"]:
        notes.append(f"dense bool mask ({_mib(row['mask_bytes'])} MiB, held by the caller)")
    if row["chose"]:
        notes.append(f"→ {row['chose']}")
    if row["compile_seconds"] is not None:
        notes.append(f"compile {row['compile_seconds']:.1f} s")
    gflops = "—" if row["gflops"] is None else f"{row['gflops']:.1f}"
    ratio = "—" if row["vs_sdpa"] is None else f"{row['vs_sdpa']:.2f}"
    return (
        f"{row['dtype']:<6}{row['mask']:<13}{row['n']:>6}  {row['backend']:<10}"
        f"{row['seconds'] * 1e3:>10.2f}{gflops:>9}{_mib(row['peak_extra_bytes']):>10}{ratio:>8}"
        f"  {'; '.join(notes)}"
    ).rstrip()


def growth_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """t(2n) / t(n) for every (dtype, mask, backend) measured at both n and 2n: 2 is linear
    growth, 4 quadratic."""
    times = {(r["dtype"], r["mask"], r["backend"], r["n"]): r["seconds"] for r in rows}
    out = []
    for (dtype, mask, backend, n), seconds in times.items():
        doubled = times.get((dtype, mask, backend, 2 * n))
        if doubled is not None:
            out.append(
                {
                    "dtype": dtype,
                    "mask": mask,
                    "backend": backend,
                    "n_from": n,
                    "n_to": 2 * n,
                    "ratio": doubled / seconds,
                }
            )
    return out


def headlines(rows: list[dict[str, Any]], growth: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures where this run measured them: t(16k)/t(8k) per dtype/mask/backend,
    and tiled's peak extra MiB at n = 32768, no mask, fp32."""
    out: dict[str, Any] = {
        "growth_16k_over_8k": {
            f"{g['dtype']}/{g['mask']}/{g['backend']}": g["ratio"]
            for g in growth
            if (g["n_from"], g["n_to"]) == (8192, 16384)
        }
    }
    for r in rows:
        if (r["backend"], r["n"], r["mask"], r["dtype"]) == ("tiled", 32768, "none", "fp32"):
            peak = r["peak_extra_bytes"]
            out["tiled_peak_extra_mib_n32768_none_fp32"] = None if peak is None else peak / 2**20
    return out


def format_summary(result: dict[str, Any]) -> list[str]:
    """Growth per doubling of n, and the headline figures, as lines."""
    lines = ["", "growth t(2n)/t(n) (2 = linear, 4 = quadratic):"]
    for g in result["growth"]:
        lines.append(
            f"  {g['dtype']:<5}{g['mask']:<13}{g['backend']:<10}"
            f"{g['n_from']:>6} → {g['n_to']:<6}{g['ratio']:>6.2f}"
        )
    if not result["growth"]:
        lines.append("  (no n measured together with 2n)")
    tiled = result["headlines"].get("tiled_peak_extra_mib_n32768_none_fp32")
    if tiled is not None:
        lines.append(f"tiled, n = 32768, no mask, fp32: peak extra memory {tiled:.1f} MiB")
    if result["skipped"]:
        lines.append(f"{len(result['skipped'])} combination(s) skipped (see above)")
    return lines
