"""``Linear`` (``nn.Linear`` plus a block of its output features alone) and ``LinearRows``; the
inference copies of a Linear are tested in test_inference.py."""

import pytest
import torch
import torch.nn.functional as F

from dikkat.layers.linear import Linear, LinearRows


@pytest.mark.parametrize(("start", "stop"), [(0, 16), (16, 24), (24, 40), (0, 40), (8, 8)])
def test_rows_are_those_columns_of_the_whole_product(start, stop):
    torch.manual_seed(1)
    m = Linear(24, 40)
    x = torch.randn(3, 24, dtype=torch.float64)
    m.double()
    expected = F.linear(x, m.weight[start:stop], m.bias[start:stop])
    torch.testing.assert_close(m.forward_rows(x, start, stop), expected, rtol=0, atol=0)
    torch.testing.assert_close(LinearRows(m, start, stop)(x), m(x)[:, start:stop])


def test_linear_has_the_state_dict_and_math_of_nn_linear():
    torch.manual_seed(0)
    ours, theirs = Linear(6, 4), torch.nn.Linear(6, 4)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6)
    assert torch.equal(ours(x), theirs(x)) and ours.state_dict().keys() == {"weight", "bias"}
    with pytest.raises(TypeError, match="bias must be True or False"):
        Linear(6, 4, bias=1)


def test_linear_rows_own_nothing_and_track_their_source():
    m = Linear(6, 9)
    rows = LinearRows(m, 3, 6)
    assert list(rows.parameters()) == [] and rows.state_dict() == {}
    assert (rows.in_features, rows.out_features) == (6, 3)
    assert rows.weight.data_ptr() == m.weight[3:].data_ptr()
    assert torch.equal(rows.bias, m.bias[3:6])
    m.double()  # a conversion replaces the source's tensors; the rows read them afresh
    assert rows.weight.dtype == torch.float64
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    rows(x).sum().backward()
    assert m.weight.grad[:3].eq(0).all() and m.weight.grad[3:6].ne(0).any()
    assert "rows 3:6 of Linear(6, 9)" in repr(rows)


def test_linear_rows_refuse_what_does_not_fit():
    with pytest.raises(
        TypeError, match="source must be a dikkat Linear or an inference layer, got Linear"
    ):
        LinearRows(torch.nn.Linear(4, 4), 0, 2)
    with pytest.raises(ValueError, match=r"rows \[2, 6\) do not fit the 4 output features"):
        LinearRows(Linear(4, 4), 2, 6)
