"""The one registry of weight formats (dikkat.weights.formats): its names are the static type's,
each entry's layer and kernel are what its products use, and a format is one entry."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from dikkat import kernels
from dikkat.layers import Linear
from dikkat.weights import InferenceLinear, PackedLinear, formats, inference_model, w8a8_available
from dikkat.weights.formats import (
    FORMATS,
    HALF_KINDS,
    PACKED_KINDS,
    WEIGHT_FORMATS,
    WeightFormat,
)
from dikkat.weights.half import HalfLinear


def test_the_static_type_names_the_registry_s_inference_formats():
    assert typing.get_args(WeightFormat) == WEIGHT_FORMATS
    assert set(WEIGHT_FORMATS) | set(PACKED_KINDS) | set(HALF_KINDS) == set(FORMATS)
    assert len(WEIGHT_FORMATS) + len(PACKED_KINDS) + len(HALF_KINDS) == len(FORMATS)
    assert {"F16": torch.float16, "BF16": torch.bfloat16} == HALF_KINDS


def test_every_entry_names_its_layer_and_a_kernel_of_the_kernels_package():
    ops = {getattr(kernels, n) for n in kernels.__all__ if n.endswith("_op")}
    for name, f in FORMATS.items():
        assert f.name == name
        assert issubclass(f.layer, InferenceLinear)
        assert f.kernel is None or f.kernel in ops, name
    for kind in PACKED_KINDS:
        assert FORMATS[kind].layer is PackedLinear
        assert FORMATS[kind].blocks is not None and FORMATS[kind].blocks.kind == kind
    for kind in HALF_KINDS:
        assert FORMATS[kind].layer is HalfLinear and FORMATS[kind].blocks is None


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_an_inference_copy_holds_each_linear_in_its_format_s_layer(weights):
    if weights == "w8a8" and not w8a8_available():
        pytest.skip("needs FBGEMM (x86)")
    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 16))
    copy = inference_model(model, weights)
    held = [m for m in copy.modules() if isinstance(m, InferenceLinear)]
    assert len(held) == 2
    assert all(type(m) is FORMATS[weights].layer for m in held)
    assert {m.weights_format for m in held} == {weights}


def test_a_new_format_is_one_entry(monkeypatch):
    """An entry added to the registry is what inference_model makes (a static type aside)."""
    made: list[int] = []

    class Counted(FORMATS["bf16"].layer):  # type: ignore[misc,name-defined]
        def __init__(self, *a: object) -> None:
            made.append(1)
            super().__init__(*a)

    entry = dataclasses.replace(FORMATS["bf16"], name="bf16-counted", layer=Counted)
    monkeypatch.setitem(formats.FORMATS, "bf16-counted", entry)
    monkeypatch.setattr(formats, "WEIGHT_FORMATS", (*WEIGHT_FORMATS, "bf16-counted"))
    copy = inference_model(Linear(32, 8), "bf16-counted")  # type: ignore[arg-type]
    assert made == [1] and isinstance(copy, Counted)
