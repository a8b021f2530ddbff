"""Leaks an audit with one absolute tolerance and random token values reports as ok: one of 1e-5
of the output scale, one in a tiny output beside huge ones, one that fires for a single token
id. Each is found, at the position it is, and a correct model still passes; the report says
what was varied, in which dtype, and the tolerance.

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from audit_models import CausalLM, GatedLeakLM, SmallLeakLM, TinyOutputLM, V, all_pairs, gpt

from dikkat import audit

T = 10


@pytest.mark.parametrize("size", [1e-5, 1e-7])
def test_a_leak_far_below_the_output_scale_is_found(size):
    report = audit.causality(SmallLeakLM(size), V, T)
    assert not report.ok, str(report)
    assert report.leaks == all_pairs(T, lambda i, j: j == i + 1)
    assert report.jacobian_leaks == report.leaks  # float64 gradients see it too
    assert report.checked.rtol == 1e-9 and report.checked.precision.startswith("float64")


@pytest.mark.parametrize("tiny, jacobian", [("logit", True), ("position", False)])
def test_a_leak_in_a_tiny_output_beside_huge_ones_is_found(tiny, jacobian):
    # "position": the value sweep alone (the gradients judge each position apart already)
    report = audit.causality(TinyOutputLM(tiny), V, T, jacobian=jacobian)
    assert not report.ok, str(report)
    assert report.leaks == ((3, 5),)
    assert report.first_leak == (3, 5)


@pytest.mark.parametrize("value", [0, 17, 30])
def test_a_leak_that_fires_for_one_token_id_is_found(value):
    report = audit.causality(GatedLeakLM(value), V, T)
    assert not report.ok, str(report)
    assert report.leaks == ((2, 6),)
    assert report.checked.every_value and report.checked.values == V


def test_a_correct_model_passes_and_the_report_says_what_it_varied():
    report = audit.causality(CausalLM(), V, T)
    assert report.ok and report.unread == (), str(report)
    text = str(report)
    assert f"each key set to every one of the {V} token ids" in text
    assert "in each of 2 trials × 2 random rows of 10 tokens" in text
    assert "float64, a copy of the model" in text
    assert "above 1e-09 × that output's own dependence" in text
    line = report.coverage()  # what the command prints for each audit
    assert "every one of the 32 token ids" in line and "float64" in line and "1e-09" in line


def test_a_vocabulary_larger_than_values_is_sampled_and_the_share_stated():
    report = audit.causality(CausalLM(), V, T, values=8)
    assert report.ok, str(report)
    assert report.checked.values == 8 and not report.checked.every_value
    assert "8 of the 32 token ids (25%, drawn afresh for each key and trial)" in str(report)


def test_the_model_given_is_not_converted_and_a_plain_function_runs_as_given():
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = audit.causality(model, V, T)
    assert copy.checked.precision == "float64, a copy of the model"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    held = audit.causality(partial(model, mask=None), V, T)  # a partial holding the model
    assert held.checked.precision.startswith("float64") and held.ok
    plain = audit.causality(lambda ids: model(ids), V, T)
    assert plain.ok and plain.checked.precision.startswith("float32, as given: a plain function")
    assert plain.checked.rtol == 1e-6
    native = audit.causality(model, V, T, dtype=None)
    assert native.checked.precision == "float32, as given, dtype=None"


class Float32Only(CausalLM):
    """A model whose kernel takes float32 alone, as a custom one might."""

    def forward(self, ids):
        if self.qkv.weight.dtype != torch.float32:
            raise RuntimeError("this kernel takes float32 only")
        return super().forward(ids)


def test_a_model_whose_float64_copy_fails_is_audited_as_given_saying_why():
    report = audit.causality(Float32Only(), V, T)
    assert report.ok, str(report)
    assert report.checked.precision.startswith("float32, as given: its float64 copy failed")
    assert "this kernel takes float32 only" in report.checked.precision


def test_values_stacked_in_one_call_find_what_one_value_a_call_finds():
    model = GatedLeakLM(17)
    stacked = audit.causality(model, V, T)
    valid = torch.ones(2, T, dtype=torch.bool)  # a B-row tensor: more rows cannot be given
    one_by_one = audit.causality(lambda ids: model(ids) * valid[..., None], V, T)
    assert stacked.checked.rows_per_call > 2 and one_by_one.checked.rows_per_call == 2
    assert stacked.leaks == one_by_one.leaks == ((2, 6),)


def test_noise_above_an_outputs_own_tolerance_is_refused_not_called_a_leak():
    model = TinyOutputLM("logit")
    gen = torch.Generator().manual_seed(0)

    def noisy(ids):  # noise of 1e-9 of the largest output: far above the tiny one's scale
        out = model(ids)
        return out + 1e-9 * out.abs().max() * torch.randn(out.shape, generator=gen).to(out)

    with pytest.raises(ValueError, match="different outputs for the same inputs"):
        audit.causality(noisy, V, T, dtype=None, rtol=1e-6)


def test_a_sweep_too_large_to_keep_is_refused_before_it_starts(monkeypatch):
    monkeypatch.setattr("dikkat.audit.sweep.MOVED_BYTES", 2**18)
    with pytest.raises(
        ValueError, match=r"would keep 0\.5 MiB .* = 32² · 2 · 32\), above 0\.25 MiB"
    ):
        audit.causality(CausalLM(), V, 32)


def test_bad_values_and_dtype_are_refused_in_words():
    with pytest.raises(ValueError, match="values must be a positive int or None, got 0"):
        audit.causality(CausalLM(), V, T, values=0)
    with pytest.raises(TypeError, match=r"dtype must be a floating torch\.dtype or None"):
        audit.causality(CausalLM(), V, T, dtype=torch.int64)
