"""The CPU fast path for weights: oneDNN-packed inference."""

import pytest
import torch
import torch.nn.functional as F

from dikkat.layers.linear import (
    Linear,
    _onednn_linear_available,
    packed_for_inference,
    release_packed,
)

needs_onednn = pytest.mark.skipif(not _onednn_linear_available(), reason="oneDNN not available")


@needs_onednn
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 7, 24), (5, 24)])
def test_packed_linear_equals_plain(transposed, shape):
    torch.manual_seed(0)
    m = Linear(24, 40)
    if transposed:  # a weight whose memory is laid out (in, out): packing reads any strides
        m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t())
    x = torch.randn(shape)
    expected = F.linear(x.double(), m.weight.double(), m.bias.double())
    with torch.no_grad(), packed_for_inference(m):
        assert m.use_packed
        got = m(x)
    assert not m.use_packed
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_packed_copy_follows_weight_updates_and_can_be_released():
    torch.manual_seed(0)
    m = Linear(16, 8)
    x = torch.randn(1, 16)
    with torch.no_grad(), packed_for_inference(m):
        first = m(x)
        kept = m.packed_weight()
        assert m.packed_weight() is kept  # reused while the weight is unchanged
        m.weight.mul_(2.0)  # an in-place update (an optimizer step) must not leave it stale
        second = m(x)
    torch.testing.assert_close(second - m.bias, 2 * (first - m.bias), atol=1e-5, rtol=1e-5)
    release_packed(m)
    assert m._packed is None


@needs_onednn
def test_packed_path_is_off_while_autograd_records():
    m = Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with packed_for_inference(m):
        y = m(x)  # grad enabled: the plain, differentiable path
    y.sum().backward()
    assert x.grad is not None and m._packed is None
