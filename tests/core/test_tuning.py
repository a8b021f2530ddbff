"""The tuning table: measured constants by device type, reasoned defaults elsewhere, and auto's
order readable in one place."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dikkat.core import AUTO_ORDER, auto_order, available_backends, explain, masks, tuning


def test_each_device_type_gets_its_entry_or_the_default() -> None:
    assert tuning.for_device("cpu") is tuning.CPU
    assert tuning.for_device(torch.device("cpu")) is tuning.CPU
    assert tuning.for_device("cuda:1") is tuning.CUDA  # by type, not index
    assert tuning.for_device("meta") is tuning.DEFAULT  # no measurement: no CPU figures
    assert tuning.DEFAULT.rows_speed != tuning.CPU.rows_speed


def test_the_entries_are_complete_and_frozen() -> None:
    for entry in (tuning.CPU, tuning.CUDA, tuning.DEFAULT):
        assert set(entry.rows_speed) == {64, 128, 256} and entry.rows_speed[128] == 1.0
        assert 0 < entry.sdpa_avoid_max_visible < 1
        assert entry.linear_chunk > 0 and entry.linear_segment > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.CPU.linear_chunk = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        tuning.CPU.rows_speed[64] = 2.0  # type: ignore[index]
    with pytest.raises(TypeError):
        tuning.TABLE["cpu"] = tuning.DEFAULT  # type: ignore[index]


def test_auto_compiles_flex_nowhere_without_a_measurement() -> None:
    assert tuning.CPU.flex_auto_compile_min_cells is None
    assert tuning.DEFAULT.flex_auto_compile_min_cells is None


def test_auto_order_is_one_tuple() -> None:
    assert AUTO_ORDER == ("sdpa", "triton", "flex", "tiled", "reference")
    assert auto_order()[: len(AUTO_ORDER)] == AUTO_ORDER
    assert "linear" in available_backends() and "linear" not in auto_order()


def test_the_sdpa_threshold_is_the_devices() -> None:
    """On CPU auto passes SDPA by for a 1024² call whose mask shows at most a quarter of it
    (CPU.sdpa_avoid_*); a smaller call stays with SDPA."""
    q = k = v = torch.randn(1, 1, 1024, 8)
    assert tuning.CPU.sdpa_avoid_min_cells <= 1024 * 1024
    assert explain(q, k, v, masks.sliding_window(64)).startswith("tiled (not sdpa:")
    small = q[:, :, :512]
    assert tuning.CPU.sdpa_avoid_min_cells > 512 * 512
    assert explain(small, small, small, masks.sliding_window(64)).startswith("sdpa")
