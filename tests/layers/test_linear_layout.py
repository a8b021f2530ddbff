"""The CPU fast paths for weights: column-major storage and oneDNN-packed inference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dikkat.layers.layout import store_column_major
from dikkat.layers.linear import (
    Linear,
    _onednn_linear_available,
    packed_for_inference,
    release_packed,
)

needs_onednn = pytest.mark.skipif(not _onednn_linear_available(), reason="oneDNN not available")


def test_column_major_keeps_values_names_and_ties():
    torch.manual_seed(0)
    emb = nn.Embedding(11, 6)
    head = Linear(6, 11, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "proj": Linear(6, 4)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    store_column_major(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k])
    assert model["head"].weight is model["emb"].weight
    assert model["proj"].weight.stride() == (1, 4)  # (out, in) stored as (in, out)
    # layout survives load_state_dict and dtype casts
    model.load_state_dict(before)
    assert model["proj"].weight.stride() == (1, 4)
    assert model.to(torch.float64)["proj"].weight.stride() == (1, 4)


def test_column_major_gives_the_same_gradients():
    torch.manual_seed(0)
    a = Linear(8, 5)
    b = store_column_major(Linear(8, 5))
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 8)
    for m in (a, b):
        m(x).square().sum().backward()
    torch.testing.assert_close(a.weight.grad, b.weight.grad)
    assert b.weight.grad.stride() == b.weight.stride()  # the gradient follows the layout


@needs_onednn
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 7, 24), (5, 24)])
def test_packed_linear_equals_plain(column_major, shape):
    torch.manual_seed(0)
    m = Linear(24, 40)
    if column_major:
        store_column_major(m)
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
