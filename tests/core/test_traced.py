"""dikkat.attention where values never reach Python: torch.compile, torch.export, torch.func.

The reference, sdpa and auto backends here (the tiled and flex backends have their own files);
every mask kind, a bias; compiled and transformed results against eager, whose numerics the
other files hold to the fp64 reference.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import dikkat
from dikkat import masks
from dikkat.functional import scaled_dot_product_attention

BACKENDS = ("reference", "sdpa", "auto")
B, H, G, T, D = 2, 4, 2, 6, 8


def _masks() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(2),
        "padding": masks.padding(torch.tensor([6, 3])),
        "left padding": masks.padding(
            valid=torch.arange(T).expand(B, T) >= torch.tensor([[0], [2]])
        ),
        "document": masks.document(torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])),
        "prefix_lm": masks.prefix_lm(torch.tensor([2, 4])),
        "bool tensor": torch.rand(B, 1, T, T, generator=g) > 0.3,
        "combined": masks.causal() & ~masks.sliding_window(1),
    }


MASKS = _masks()


def _inputs(dtype: torch.dtype = torch.float32, batch: tuple[int, ...] = ()) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(*batch, B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(*batch, B, G, T, D, generator=g, dtype=dtype)
    v = torch.randn(*batch, B, G, T, D, generator=g, dtype=dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MASKS)
def test_no_graph_break_and_compiled_equals_eager(backend: str, name: str) -> None:
    mask = MASKS[name]
    bias = torch.randn(1, H, T, T)

    def f(q, k, v):
        return dikkat.attention(q, k, v, mask, bias=bias, backend=backend)

    q, k, v = _inputs()
    compiled = torch.compile(f, fullgraph=True, backend="eager")  # fullgraph: a break fails
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


def test_inductor_compiles_a_causal_call_and_its_gradient() -> None:
    q, k, v = (t.requires_grad_() for t in _inputs())

    def f(q, k, v):
        return dikkat.attention(q, k, v, masks.causal())

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for got, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["none", "causal", "padding", "bool tensor"])
def test_vmap_equals_a_loop(backend: str, name: str) -> None:
    mask = MASKS[name]
    q, k, v = _inputs(torch.float64, batch=(3,))

    def f(q, k, v):
        return dikkat.attention(q, k, v, mask, backend=backend)

    got = torch.func.vmap(f)(q, k, v)
    want = torch.stack([f(q[i], k[i], v[i]) for i in range(3)])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["causal", "padding"])
def test_jacrev_and_batched_gradcheck(backend: str, name: str) -> None:
    mask = masks.padding(torch.tensor([3])) if name == "padding" else MASKS[name]
    q, k, v = (t[:1, :2, :4] for t in _inputs(torch.float64))  # small: the jacobian is dense

    def f(q, k, v):
        return dikkat.attention(q, k, v, mask, backend=backend)

    jac = torch.func.jacrev(f, argnums=(0, 1, 2))(q, k, v)
    want = torch.autograd.functional.jacobian(f, (q, k, v))
    for got, w in zip(jac, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-12, rtol=1e-12)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(f, inputs, check_batched_grad=True)


class _Attend(torch.nn.Module):
    def __init__(self, mask: object) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return dikkat.attention(q, k, v, self.mask)


@pytest.mark.parametrize("name", ["none", "causal", "window", "padding"])
def test_export_runs_and_equals_eager(name: str) -> None:
    module = _Attend(MASKS[name])
    q, k, v = _inputs()
    program = torch.export.export(module, (q, k, v))
    q2, k2, v2 = (t.flip(0) for t in (q, k, v))  # other values, the same shapes
    torch.testing.assert_close(program.module()(q2, k2, v2), module(q2, k2, v2))


def test_a_non_finite_input_is_an_error_when_compiled() -> None:
    q, k, v = _inputs()
    compiled = torch.compile(lambda q, k, v: dikkat.attention(q, k, v), backend="aot_eager")
    compiled(q, k, v)
    v[1, 0, 2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="holds a NaN or ±inf"):
        compiled(q, k, v)


def test_a_non_finite_input_is_an_error_under_vmap() -> None:
    q, k, v = _inputs(batch=(2,))
    k[1, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"holds a NaN or ±inf .*torch\.func transform"):
        torch.func.vmap(lambda q, k, v: dikkat.attention(q, k, v))(q, k, v)


def test_a_minus_inf_bias_still_hides_a_key_when_compiled() -> None:
    q, k, v = _inputs()
    bias = torch.zeros(1, 1, T, T)
    bias[..., 0] = float("-inf")
    f = lambda q, k, v: dikkat.attention(q, k, v, bias=bias)  # noqa: E731
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, dikkat.attention(q[..., :, :], k[:, :, 1:], v[:, :, 1:]))


def test_capture_of_a_compiled_layer_records_what_eager_does() -> None:
    """dynamo runs capture's hooks eagerly (they set a ContextVar it cannot trace), so the
    layer's forward records; were the call traced, capture_target would refuse by name."""
    layer = dikkat.layers.MultiHeadAttention(16, 2)
    x = torch.randn(1, 4, 16)
    with dikkat.capture(layer) as want:
        layer(x)
    with dikkat.capture(layer) as got:
        torch.compile(layer, backend="eager")(x)
    torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_drop_in_compiles_exports_and_vmaps(backend: str) -> None:
    q, k, v = _inputs()
    mask = torch.rand(T, T, generator=torch.Generator().manual_seed(2)) > 0.4

    def f(q, k, v):
        return scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True, backend=backend
        )

    want = f(q, k, v)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(q, k, v), want)
    qb, kb, vb = _inputs(batch=(2,))
    got = torch.func.vmap(f)(qb, kb, vb)
    torch.testing.assert_close(got, torch.stack([f(qb[i], kb[i], vb[i]) for i in range(2)]))
