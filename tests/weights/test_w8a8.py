"""The w8a8 format: FBGEMM's dynamic quantised product against an fp64 bound, one row at a time,
and the linear layers of ``inference_model(model, "w8a8")``.

Notation: ``N`` output features, ``K`` input features, ``M`` input rows.
"""

from __future__ import annotations

import pytest
import torch

from dikkat.layers import Linear, LinearRows
from dikkat.weights import (
    dequantize_int8,
    inference_model,
    quantize_int8,
    quantize_w8a8,
    w8a8_available,
    w8a8_linear,
)

pytestmark = pytest.mark.skipif(not w8a8_available(), reason="needs PyTorch's FBGEMM (x86)")

LEVELS = 127  # FBGEMM's inputs with reduce_range: 7 bits, 128 codes between min(x, 0) and max(x, 0)


def weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * 10.0 ** torch.linspace(-2, 1, N)[:, None]


@pytest.mark.parametrize("K, shape", [(64, (1, 64)), (64, (3, 64)), (20, (2, 3, 20))])
def test_the_product_is_the_int8_weights_times_an_input_rounded_to_its_range(K, shape):
    """Each row's error is at most half its input step times Σ|w| (plus fp32 sums): the
    weight's int8 values are exact in the product, only the input is rounded."""
    w, b = weight(24, K, seed=1), torch.randn(24)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    out = w8a8_linear(x, quantize_w8a8(w, b))
    assert out.shape == (*shape[:-1], 24) and out.dtype == x.dtype
    w64 = dequantize_int8(quantize_int8(w), torch.float64)
    rows = x.double().reshape(-1, K)
    ref = rows @ w64.T + b.double()
    step = (rows.amax(1).clamp_min(0) - rows.amin(1).clamp_max(0)) / LEVELS  # (M,)
    bound = step[:, None] / 2 * w64.abs().sum(1) + 1e-5 * (rows.abs() @ w64.abs().T + 1)
    err = (out.double().reshape(-1, 24) - ref).abs()
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.05  # the inputs really were rounded


def test_a_row_s_result_does_not_depend_on_the_other_rows():
    """FBGEMM takes one input scale per call; rows go one at a time, so a batch gives each row
    what it gives alone (a server's requests stay independent)."""
    q = quantize_w8a8(weight(16, 32), torch.randn(16))
    x = torch.randn(4, 32)
    x[2] *= 1000  # one row with a far wider range than the others
    together = w8a8_linear(x, q)
    for i in range(4):
        assert torch.equal(together[i], w8a8_linear(x[i : i + 1], q)[0])


def test_no_rows_give_no_rows_and_a_wrong_width_is_refused():
    q = quantize_w8a8(weight(8, 16))
    assert w8a8_linear(torch.randn(0, 16), q).shape == (0, 8)
    with pytest.raises(ValueError, match=r"16 input features, got \(1, 8\)"):
        w8a8_linear(torch.randn(1, 8), q)


def test_only_cpu_weights_are_packed():
    with pytest.raises(ValueError, match=r"runs on the CPU only.*meta"):
        quantize_w8a8(torch.empty(4, 4, device="meta"))


def test_a_w8a8_copy_multiplies_in_w8a8_and_the_linear_keeps_its_parameters():
    torch.manual_seed(0)
    m = Linear(32, 24).double()
    x = torch.randn(2, 32, dtype=torch.float64)  # any float input: multiplied in fp32
    before = m.weight.detach().clone()
    copy = inference_model(m, "w8a8")
    got = copy(x)
    expected = w8a8_linear(x, quantize_w8a8(m.weight, m.bias))
    assert {(a, b) for a, b, _ in copy.copies} == {(0, 24)}  # packed on first use
    with torch.no_grad():
        exact = torch.nn.functional.linear(x, m.weight, m.bias)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert float((got - exact).abs().max()) > 0  # the int8 copy, not the weight, was used
    assert torch.equal(m.weight, before)


def test_w8a8_rows_of_a_copy_are_the_rows_packed_alone():
    torch.manual_seed(1)
    m = Linear(32, 24)
    copy = inference_model(LinearRows(m, 8, 20), "w8a8")
    x = torch.randn(3, 32)
    w, b = m.weight[8:20].detach(), m.bias[8:20].detach()
    assert torch.equal(copy(x), w8a8_linear(x, quantize_w8a8(w, b)))


def test_a_w8a8_copy_is_refused_off_the_cpu_when_it_is_made():
    with pytest.raises(ValueError, match=r"runs on the CPU only.*meta"):
        inference_model(Linear(4, 4, device="meta"), "w8a8")
