"""benchmarks/hf_long_context.py at tiny sizes: the logits check, one configuration measured in
its own process, and a run refused because its predicted memory exceeds the limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import hf_long_context

    return hf_long_context


def test_check_compares_every_implementation_with_a_window_that_hides_keys(script, capsys):
    report = script.check(n=48, window=16)
    assert set(report) == {f"{m}/{i}" for m in ("causal", "window") for i in script.IMPLS[:4]}
    for key, row in report.items():
        assert all(d <= 1e-4 for d in row["max_abs_diff"].values()), key
    layers = report["window/dikkat-tiled"]["layers"]
    assert layers == ["MistralAttention[0] tiled", "MistralAttention[1] tiled"]
    assert "it hides keys" in capsys.readouterr().out


def test_one_configuration_runs_in_its_own_process(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--sizes", "64", "--window", "16", "--masks", "window", "--impls", "dikkat-tiled"]
    results = script.main([*argv, "--repeats", "1", "--out", str(out)])
    r = results["window/64/dikkat-tiled"]
    assert r["ms"] > 0 and r["first_ms"] > 0 and r["runs"] == 1
    assert [backend for _, backend in r["backends"]] == ["tiled", "tiled"]
    assert r["process_bytes"] >= r["watched_bytes"] > 0
    assert json.loads(out.read_text())["results"].keys() == {"window/64/dikkat-tiled"}


def test_a_run_predicted_above_the_limit_is_recorded_not_started(script, tmp_path):
    # eager at T = 32768 holds one layer's scores and softmax: 2 × 8 heads × 32768² × 4 bytes
    need = script.predicted_bytes("eager", "causal", 32768, 4096)
    assert need > 64 * 2**30
    out = tmp_path / "r.json"
    argv = ["--sizes", "32768", "--masks", "causal", "--impls", "eager", "--out", str(out)]
    results = script.main(argv)
    assert results["causal/32768/eager"]["skipped"] == f"needs ≈ {need / 2**30:.1f} GiB, not run"
    assert script.predicted_bytes("sdpa", "causal", 32768, 4096) < 4 * 2**30
