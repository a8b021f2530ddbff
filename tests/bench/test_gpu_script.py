"""benchmarks/gpu.py without a GPU: the pairs its FLOP count credits are the ones each mask
allows, and without CUDA it times nothing."""

import importlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dikkat import masks

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu")


@pytest.mark.parametrize("n", [1, 50, 64, 200])
def test_visible_pairs_count_what_each_mask_allows(gpu, n):
    plan = replace(gpu.SMOKE, window=17, doc_len=64)
    built = {
        "none": masks.full(),
        "causal": masks.causal(),
        "window": masks.sliding_window(plan.window),
        "documents": masks.document(torch.arange(n) // plan.doc_len),
    }
    for kind in gpu.MASKS:
        allowed = built[kind].materialize(1, 1, n, n).expand(1, 1, n, n)
        assert gpu.visible_pairs(kind, n, plan) == int(allowed.sum()), kind


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would time the GPU")
def test_without_cuda_it_says_so_and_times_nothing(gpu, capsys, tmp_path):
    assert gpu.main(["--out", str(tmp_path)]) is None
    assert "no CUDA" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())
