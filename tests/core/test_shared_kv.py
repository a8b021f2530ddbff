"""Keys and values shared by the batch: q (B, H, T, D) against k, v (1, G, S, ·) — a shared
prefix, a shared memory. Every backend must give what it gives with k and v copied out to every
sequence, and the gradient of the shared k and v is the sum over the batch of theirs (checked
against that copy in fp64, the reference never trusted with the broadcast).
"""

import importlib.util

import pytest
import torch

import dikkat
from dikkat import masks
from dikkat.core import tiled

HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
BACKENDS = ("reference", "tiled", "sdpa", "auto", *(("flex",) if HAS_FLEX else ()))

B, H, G, T, S, D = 3, 4, 2, 7, 11, 16

MASKS = {
    "none": None,
    "causal-bottom-right": masks.causal(),
    "padding-per-sequence": masks.padding(torch.tensor([11, 4, 0])),  # sequence 2 sees no key
    "window-ahead": masks.sliding_window(3, ahead=2),
    "dense-per-sequence": torch.rand(B, 1, T, S, generator=torch.manual_seed(0)) < 0.6,
}


def inputs(seed: int, Dv: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, G, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, G, S, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def copied_out(q, k, v, dout, mask, **kwargs) -> tuple[torch.Tensor, ...]:
    """The fp64 reference with k and v copied to every sequence, their gradients summed back."""
    leaves = [q.clone().requires_grad_(), *(t.repeat(B, 1, 1, 1).requires_grad_() for t in (k, v))]
    out = dikkat.attention(*leaves, mask, backend="reference", **kwargs)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return out, dq, dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_equals_the_copied_out_reference(backend, mask_name, with_bias):
    q, k, v, dout = inputs(seed=len(mask_name))
    kwargs = {"q_offset": S - T if mask_name == "causal-bottom-right" else 0}
    if with_bias:
        kwargs["bias"] = torch.randn(B, 1, T, S, generator=torch.manual_seed(3), dtype=q.dtype)
    mask = MASKS[mask_name]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dikkat.attention(*leaves, mask, backend=backend, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    for name, a, b in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), copied_out(q, k, v, dout, mask, **kwargs),
        strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("windows", [True, False])
@pytest.mark.parametrize("fused", [None, False])
def test_tiled_in_many_tiles(windows, fused):
    """Gathered windows (batch folded into the kernel's) and rows, in the fused CPU kernel where
    it runs (Dv = D) or in plain ops."""
    q, k, v, dout = inputs(seed=9, Dv=D)
    mask = masks.sliding_window(4, ahead=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = tiled.tiled_attention(
        *leaves, mask, scale=D**-0.5, block=2, key_tile=3, windows=windows, fused=fused,
        plans=tiled.PlanCache(),
    )  # fmt: skip
    want = copied_out(q, k, v, dout, mask)
    torch.testing.assert_close(out, want[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_attention_weights_and_explain_take_shared_keys():
    q, k, v, _ = inputs(seed=4)
    mask = masks.causal() & masks.padding(torch.tensor([9, 11, 2]))
    _, (_, lse) = dikkat.attention(q, k, v, mask, backend="tiled", return_lse=True)
    weights = dikkat.attention_weights(q, k, lse, mask=mask, rows=[0, 5], heads=[1, 3])
    _, (want, _) = dikkat.attention(
        q, k.repeat(B, 1, 1, 1), v.repeat(B, 1, 1, 1), mask, return_weights=True
    )
    torch.testing.assert_close(weights, want[:, [1, 3]][:, :, [0, 5]], rtol=1e-12, atol=1e-12)
    assert dikkat.explain(q, k, v, mask).split(" ")[0] in dikkat.available_backends()


def test_a_nan_in_a_shared_key_reaches_every_sequence_that_sees_it():
    q, k, v, _ = inputs(seed=5)
    k = k.clone()
    k[0, 0, 6, 2] = float("nan")  # key 6 of kv head 0: query heads 0 and 1
    out = dikkat.attention(q, k, v, masks.causal(), q_offset=S - T, backend="tiled")
    reached = torch.zeros(B, H, T, dtype=torch.bool)
    reached[:, :2, 6 - (S - T) :] = True  # queries at positions ≥ 6, every sequence
    assert out.isnan().any(-1).equal(reached)


def test_other_batch_sizes_are_refused_naming_the_shapes():
    q, k, v, _ = inputs(seed=6)
    with pytest.raises(ValueError, match=r"batch sizes differ: q \(3, 4, 7, 16\), k \(2, 2, 11"):
        dikkat.attention(q, k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1))
