"""The CPU fast path for weights: oneDNN-packed inference; row blocks of a Linear (LinearRows)."""

import pytest
import torch
import torch.nn.functional as F

from dikkat.layers.linear import (
    Linear,
    LinearRows,
    onednn_linear_available,
    packed_for_inference,
    release_packed,
)

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN not available")


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
def test_a_batched_block_lays_a_second_copy_out_for_many_rows():
    """batched=True: products of more than two rows use a copy laid out for batches (the same
    numbers up to rounding); an unbatched block multiplies every shape through one copy."""
    torch.manual_seed(0)
    m = Linear(24, 40)
    x = torch.randn(8, 24)
    expected = F.linear(x.double(), m.weight.double(), m.bias.double())
    for batched, layouts in ((False, {1}), (True, {1, 8})):
        with torch.no_grad(), packed_for_inference(m, batched=batched):
            got = m(x)
            with packed_for_inference(m):  # an inner block keeps the outer one's choice
                m(torch.randn(3, 24))
            m.inference_copy("fp32", 0, 40)  # the one-row layout, as a decoding step uses
            assert {rows for *_, rows in m._copies} == layouts
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), packed_for_inference(m, "int8", batched=True):
        m(x), m(x[:1])
        assert len(m._copies) == 1  # a copy with no oneDNN layout is made once
    with pytest.raises(TypeError, match="batched"), packed_for_inference(m, batched=1):
        pass


@needs_onednn
def test_packed_copy_follows_weight_updates_and_can_be_released():
    torch.manual_seed(0)
    m = Linear(16, 8)
    x = torch.randn(1, 16)
    with torch.no_grad(), packed_for_inference(m):
        first = m(x)
        kept = m.packed_weight()
        assert m.packed_weight() is kept  # reused while the weight is unchanged
        m.weight.mul_(2.0)  # an in-place update inside the block must not leave it stale
        second = m(x)
        assert m.packed_copies == {(0, 8)}
        release_packed(m)
        assert m.packed_copies == frozenset()
    torch.testing.assert_close(second - m.bias, 2 * (first - m.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_copies_live_until_the_outermost_block_ends():
    m = Linear(16, 8)
    x = torch.randn(1, 16)
    with torch.no_grad(), packed_for_inference(m):
        m(x)
        kept = m.packed_weight()
        with packed_for_inference(m):  # a generate call inside a held block packs nothing new
            m(x)
            assert m.packed_weight() is kept
        assert m.use_packed and m.packed_copies == {(0, 8)}
    assert not m.use_packed and m.packed_copies == frozenset()


@needs_onednn
def test_a_fused_optimizer_step_between_blocks_is_never_missed():
    """torch's fused AdamW writes the weights without moving their version counters, so a
    packed copy kept from one block to the next could not see the step."""
    torch.manual_seed(3)
    m = Linear(16, 8)
    x = torch.randn(2, 16)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    with torch.no_grad(), packed_for_inference(m):
        before = m(x)
    m(x).square().sum().backward()
    opt.step()
    with torch.no_grad():
        plain = m(x)
        with packed_for_inference(m):
            packed = m(x)
    assert not torch.allclose(plain, before, atol=1e-3)  # the step changed the weights
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_packed_path_is_off_while_autograd_records():
    m = Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with packed_for_inference(m):
        y = m(x)  # grad enabled: the plain, differentiable path
    y.sum().backward()
    assert x.grad is not None and m.packed_copies == frozenset()


@needs_onednn
@pytest.mark.parametrize(("start", "stop"), [(0, 16), (16, 24), (24, 40), (0, 40)])
def test_packed_rows_equal_the_plain_rows(start, stop):
    torch.manual_seed(1)
    m = Linear(24, 40)
    rows = LinearRows(m, start, stop)
    x = torch.randn(3, 24)
    expected = F.linear(x.double(), m.weight[start:stop].double(), m.bias[start:stop].double())
    with torch.no_grad():
        plain = rows(x)
        with packed_for_inference(m):
            packed = rows(x)
            assert m.packed_copies == {(start, stop)}
    torch.testing.assert_close(plain.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.double(), expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_packed_rows_follow_weight_updates_and_are_released():
    torch.manual_seed(2)
    m = Linear(16, 12, bias=False)
    k = LinearRows(m, 4, 8)
    x = torch.randn(1, 16)
    with torch.no_grad(), packed_for_inference(m):
        first = k(x)
        kept = m.packed_rows(4, 8)
        assert m.packed_rows(4, 8) is kept
        m.weight[4:8].mul_(3.0)  # an in-place update of those rows
        second = k(x)
    torch.testing.assert_close(second, 3 * first, atol=1e-5, rtol=1e-5)
    release_packed(m)
    assert m.packed_copies == frozenset()


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
