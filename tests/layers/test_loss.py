"""linear_cross_entropy against the plain formula, cross_entropy(x @ Wᵀ, y), in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dikkat.layers import linear_cross_entropy
from dikkat.layers.loss import Scratch


def _plain(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x @ w.t(), y, ignore_index=-100)


@given(
    n=st.integers(1, 40),
    c=st.integers(1, 12),
    v=st.integers(2, 30),
    chunk=st.integers(1, 50),
    ignored=st.floats(0.0, 1.0),
    scale=st.floats(-3.0, 3.0),
    seed=st.integers(0, 2**16),
)
def test_equals_plain_formula_fp64(
    n: int, c: int, v: int, chunk: int, ignored: float, scale: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, c, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    ours = linear_cross_entropy(x, w, y, chunk_size=chunk)
    (ours * scale).backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    ref = _plain(x, w, y)
    if (y == -100).all():  # nothing to score: we give 0 (the plain mean gives nan)
        assert ours.item() == 0.0 and torch.all(gx == 0) and torch.all(gw == 0)
        return
    (ref * scale).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, w.grad, rtol=1e-10, atol=1e-12)


def test_tied_weight_gradient_adds_up() -> None:
    """A weight used as embedding and output head gets both gradients (the GPT case)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 7), generator=g)
    y = torch.randint(0, 11, (3, 7), generator=g)
    linear_cross_entropy(F.embedding(ids, w).tanh(), w, y, chunk_size=4).backward()
    ours = w.grad.clone()
    w.grad = None
    _plain(F.embedding(ids, w).tanh().flatten(0, 1), w, y.flatten()).backward()
    torch.testing.assert_close(ours, w.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [3, 64])
def test_bf16_autocast_within_twice_the_plain_error(chunk: int) -> None:
    """Under bf16 autocast (bf16 products, fp32 softmax and sums) our error against fp64 is at
    most twice that of the plain formula run under the same autocast."""
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(20, 16, generator=g, dtype=torch.float64)
    w64 = torch.randn(40, 16, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, 40, (20,), generator=g)

    def run(fn):  # (loss, dx, dw) of fn in fp32 under bf16 autocast
        x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(x, w)
        loss.backward()
        assert loss.dtype == x.grad.dtype == w.grad.dtype == torch.float32
        return [t.detach().double() for t in (loss, x.grad, w.grad)]

    ours = run(lambda x, w: linear_cross_entropy(x, w, y, chunk_size=chunk))
    plain = run(lambda x, w: F.cross_entropy((x @ w.t()).float(), y))
    x64.requires_grad_(), w64.requires_grad_()
    ref = _plain(x64, w64, y)
    ref.backward()
    for a, b, r in zip(ours, plain, (ref.detach(), x64.grad, w64.grad), strict=True):
        assert (a - r).abs().max() <= 2 * (b - r).abs().max() + 1e-6


def test_bad_input_names_the_shapes() -> None:
    x, w = torch.randn(4, 8), torch.randn(10, 6)
    with pytest.raises(ValueError, match=r"x \(4, 8\), weight \(10, 6\)"):
        linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="one integer id per row"):
        linear_cross_entropy(torch.randn(4, 6), w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="scratch must be a Scratch"):
        linear_cross_entropy(torch.randn(4, 6), w, torch.zeros(4, dtype=torch.long), scratch={})
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(torch.randn(4, 6), w, torch.zeros(4, dtype=torch.long), chunk_size=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_scratch_reused_across_calls_changes_nothing(bf16: bool) -> None:
    """One Scratch across calls of different sizes, chunkings and dtypes (buffers reused,
    resized, or replaced) gives bit for bit what fresh buffers give."""
    scratch = Scratch()
    g = torch.Generator().manual_seed(2)
    for n, v, chunk, dtype in [
        (9, 13, 4, torch.float32),
        (9, 13, 4, torch.float32),  # the same shapes: every buffer reused
        (5, 13, 8, torch.float32),  # fewer rows than a chunk
        (12, 7, 5, torch.float64),
        (9, 13, 4, torch.float32),
    ]:
        x = torch.randn(n, 6, generator=g, dtype=dtype)
        w = torch.randn(v, 6, generator=g, dtype=dtype)
        y = torch.randint(0, v, (n,), generator=g)
        y[0] = -100
        results = []
        for s in (None, scratch):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = linear_cross_entropy(xs, ws, y, chunk_size=chunk, scratch=s)
            loss.backward()
            results.append((loss.detach(), xs.grad, ws.grad))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)


def test_scratch_is_not_pickled_or_copied() -> None:
    import copy
    import pickle

    scratch = Scratch()
    scratch.get("logits", (64, 1000), torch.float32, "cpu")
    assert len(pickle.dumps(scratch)) < 1000  # not the 256 kB buffer
    assert copy.deepcopy(scratch).nbytes == 0
    assert scratch.nbytes == 64 * 1000 * 4  # the original keeps its buffer
    scratch.clear()
    assert scratch.nbytes == 0
