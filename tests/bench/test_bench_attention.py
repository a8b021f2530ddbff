"""The attention benchmark end to end on a tiny configuration, its pieces against counting, the
peak-memory helper against a known allocation, and the command line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dikkat.bench.attention import (
    AttentionBenchConfig,
    build_mask,
    dense_mask,
    estimate_extra_bytes,
    run_attention_benchmark,
    save_results,
    visible_cells,
)
from dikkat.bench.report import growth_ratios
from dikkat.bench.timing import memory_tracking, peak_memory
from dikkat.cli import main

ROW_FIELDS = {
    "dtype",
    "mask",
    "n",
    "backend",
    "seconds",
    "first_call_seconds",
    "compile_seconds",
    "gflops",
    "peak_extra_bytes",
    "vs_sdpa",
    "chose",
    "mask_bytes",
}
needs_memory = pytest.mark.skipif(not memory_tracking(), reason="needs Linux with glibc")


@needs_memory
def test_peak_memory_sees_a_large_allocation_every_time():
    size = 256 * 2**20
    for _ in range(2):
        peak = peak_memory(lambda: torch.ones(size // 4))
        assert peak == pytest.approx(size, rel=0.03)
    # The trap the helper avoids: after a large block is freed, glibc's default would serve these
    # 1 MiB temporaries from heap the process already holds, and the peak would read ≈ 0.
    # The floor is the point; above it, the process may touch a page or two of its own (a CI run
    # once read 16 MiB + 1.4 MiB), so the ceiling is loose.
    peak = peak_memory(lambda: [torch.ones(2**18) for _ in range(16)])
    assert 15 * 2**20 <= peak <= 20 * 2**20


def test_quick_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "attention", "--quick", "--sizes", "64,128", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "growth t(2n)/t(n)" in printed
    result = json.loads((out / "attention.json").read_text())
    assert result["machine"]["torch"] == torch.__version__
    rows = result["rows"]
    assert {(r["mask"], r["n"]) for r in rows} == {
        (m, n) for m in ("none", "causal", "window256", "doclen1024") for n in (64, 128)
    }
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["dtype"] == "fp32" and row["seconds"] > 0 and row["vs_sdpa"] > 0
    assert {r["backend"] for r in rows} == {"sdpa", "reference", "tiled", "auto", "linear"}
    assert all(r["vs_sdpa"] == 1 for r in rows if r["backend"] == "sdpa")
    assert {(s["mask"], s["backend"]) for s in result["skipped"]} == {
        ("window256", "linear"),
        ("doclen1024", "linear"),
    }
    assert {(g["n_from"], g["n_to"]) for g in result["growth"]} == {(64, 128)}
    for name in ("attention_time.png", "attention_memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_memory
def test_the_estimates_cover_the_measured_peaks():
    config = AttentionBenchConfig(
        sizes=(512,), dtypes=("fp32",), masks=("window256",), backends=("sdpa", "reference"),
        min_time=0.01,
    )  # fmt: skip
    rows = run_attention_benchmark(config, log=lambda line: None)["rows"]
    assert [r["backend"] for r in rows] == ["sdpa", "reference"]
    for r in rows:
        assert (
            0
            < r["peak_extra_bytes"]
            <= estimate_extra_bytes(r["backend"], "window256", 512, 4, 1, 8, 64)
        )
    reference = rows[1]["peak_extra_bytes"]
    assert reference >= 8 * 512 * 512 * 4  # at least the (1, 8, 512, 512) fp32 weights


def test_what_does_not_fit_is_skipped_not_run(tmp_path):
    lines: list[str] = []
    config = AttentionBenchConfig(
        sizes=(128,), dtypes=("fp32",), masks=("window256",), backends=("sdpa", "tiled"),
        max_bytes=1,
    )  # fmt: skip
    result = run_attention_benchmark(config, log=lines.append)
    assert result["rows"] == []
    assert [s["backend"] for s in result["skipped"]] == ["sdpa", "tiled"]
    assert all("budget" in s["why"] for s in result["skipped"])
    assert save_results(result, tmp_path) == [tmp_path / "attention.json"]
    # at full scale: SDPA's dense path and the reference are the ones that cannot run at 32k
    assert estimate_extra_bytes("sdpa", "window256", 32768, 4, 1, 8, 64) > 4 * 2**30
    assert estimate_extra_bytes("reference", "none", 32768, 4, 1, 8, 64) > 32 * 2**30
    assert estimate_extra_bytes("tiled", "none", 32768, 4, 1, 8, 64) < 2**30


@pytest.mark.parametrize(
    "name", ["none", "causal", "window5", "documents3", "documents7", "doclen6"]
)
@pytest.mark.parametrize("n", [4, 20, 33])
def test_visible_cells_count_the_mask(name, n):
    mask = build_mask(name, n)
    allowed = torch.ones(n, n, dtype=torch.bool) if mask is None else mask.materialize(1, 1, n, n)
    assert visible_cells(name, n) == int(allowed.sum())
    if mask is not None:
        assert torch.equal(dense_mask(mask, n, rows=7), mask.materialize(1, 1, n, n))


def test_growth_is_time_at_2n_over_time_at_n():
    rows = [
        {"dtype": "fp32", "mask": "none", "backend": "sdpa", "n": n, "seconds": s}
        for n, s in ((1024, 1.0), (2048, 4.0), (8192, 5.0))
    ]
    assert growth_ratios(rows) == [
        {"dtype": "fp32", "mask": "none", "backend": "sdpa", "n_from": 1024, "n_to": 2048,
         "ratio": 4.0}
    ]  # fmt: skip


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "attention", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "dikkat bench attention --quick" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtypes", "fp16"],
        ["--sizes", "1024,0"],
        ["--masks", "window"],
        ["--backends", "flash"],
        ["--min-time", "-1"],
    ],
)
def test_a_bad_flag_is_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "attention", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dikkat: error:") and err.count("\n") == 1


def test_the_library_never_imports_benchmarks():
    src = Path(__file__).parents[2] / "src" / "dikkat"
    pattern = re.compile(r"^\s*(from|import)\s+(benchmarks|common)\b", re.MULTILINE)
    offenders = [p for p in src.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
