"""A NaN or ±Inf in, the same out: each native kernel (dikkat.kernels) gives what IEEE
arithmetic gives in its formula — the packed product in every format, for one row, a few, a
tile's worth and more (tests/native_nan_cases.py), and with NaN or Inf scales; the dequantised
weight; the fp32 row product; the attention over a pool of slots, against the PyTorch step it
replaces. (The greedy pick's NaN rule: tests/kernels/test_argmax.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dikkat import kernels as native
from dikkat.models.static_step import _attend
from dikkat.weights.packed import _dequantize, dequantize, packed_linear
from native_nan_cases import (
    BAD,
    FORMATS,
    check_rows,
    check_scales,
    kernel,
    packed,
    part,
    same_nonfinite,
)

ROWS = [1, 3, 17, 40]  # one; fewer than a tile of 8; tiles and a rest; past DENSE_ROWS


@pytest.fixture(scope="module")
def qmm():
    found = native.qmm_op()
    if found is None:  # the machines the suite runs on build it
        pytest.skip("no native kernels here")
    return found


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_row_s_nan_or_inf_comes_out_as_ieee_gives_it(qmm, name, bad):
    for M in ROWS:
        check_rows(kernel(qmm), name, M, bad)
        check_rows(packed_linear, name, M, bad)  # the layers' path (from 32 rows: dequantised)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize(
    "name,which",
    [(name, "scale") for name in FORMATS]
    + [(name, "offset") for name, f in FORMATS.items() if f.offsets],
)
def test_a_nan_or_inf_scale_makes_its_rows_outputs_non_finite(qmm, name, which, bad):
    for M in ROWS:
        check_scales(kernel(qmm), name, M, bad, which)


@pytest.mark.parametrize(
    "name,which", [("Q4_1", "scale"), ("Q4_1", "offset"), ("Q6_K", "scale"), ("Q4_K", "offset"),
                   ("q8", "scale")]
)  # fmt: skip
def test_the_dequantised_weight_keeps_a_nan_or_inf_scale(qmm, name, which):
    p = packed(name)
    held = part(p, which)
    held[4, 0], held[-1, -1] = float("nan"), float("inf")
    got, want = dequantize(p), _dequantize(p)
    assert (~want.isfinite()).sum() >= 2 * p.block
    assert same_nonfinite(got, want)
    assert torch.equal(got[want.isfinite()], want[want.isfinite()])


@pytest.mark.parametrize("K", [16, 33, 100])  # the 32-value steps and the masked rest
@pytest.mark.parametrize("M", [1, 3])
def test_the_fp32_row_product_keeps_nan_and_inf(M, K):
    op = native.linear_rows_op()
    if op is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(M + K)  # row 0 finite, M more with an Inf
    x, w, b = torch.randn(M + 1, K, generator=g), torch.randn(9, K, generator=g), torch.randn(9)
    w[2, K // 2] = 0.0  # Inf · 0: NaN
    x[M, K // 2] = float("inf")
    x[1, K - 1] = float("-inf") if M > 1 else x[1, K - 1]
    w[5, 0], b[7] = float("nan"), float("inf")
    want = (x.double()[:, None] * w.double()[None]).sum(-1) + b.double()
    got = op(x, w, b)
    assert not want.isfinite().all() and want.isfinite().any()
    assert same_nonfinite(got, want)
    finite = want.isfinite()
    assert torch.allclose(got[finite].double(), want[finite], rtol=1e-5, atol=1e-5)
    assert same_nonfinite(op(x, w, None), F.linear(x.double(), w.double()))


@pytest.mark.parametrize("where", ["q", "k", "v", "q inf", "k inf", "v inf", "k -inf"])
def test_the_pool_attention_keeps_nan_and_inf_as_the_pytorch_step(where):
    op = native.paged_attention_op()
    if op is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(0)
    B, H, G, D, N, S = 3, 4, 2, 24, 40, 9
    q, k, v = (torch.randn(B, H, D, generator=g), torch.randn(N, G, D, generator=g),
               torch.randn(N, G, D, generator=g))  # fmt: skip
    slots = torch.randperm(N, generator=g)[: B * S].view(B, S)
    positions = torch.tensor([8, 3, 6])
    value = float("-inf") if "-inf" in where else float("inf") if "inf" in where else float("nan")
    if where[0] == "q":
        q[1, 2, 5] = value
    else:  # a slot that row 1 attends (its token 2), in key head 0
        (k if where[0] == "k" else v)[slots[1, 2], 0, 5] = value
    got = op(q, k, v, slots, positions, 0, D**-0.5)
    # the PyTorch step's attention (dikkat.models.static_step's, without a native kernel)
    columns = torch.arange(S)
    mask = (columns <= positions[:, None]).view(B, 1, 1, S)
    k_all, v_all = k[slots].transpose(1, 2), v[slots].transpose(1, 2)  # (B, G, S, D)
    want = _attend(q[:, :, None], k_all, v_all, mask, D**-0.5)[:, :, 0]
    assert not want.isfinite().all()
    assert same_nonfinite(got, want)
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)
    assert want[0].isfinite().all() and want[2].isfinite().all()  # the other rows untouched
