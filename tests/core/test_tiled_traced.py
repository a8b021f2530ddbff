"""The tiled backend inside torch.compile, torch.export and torch.func's transforms.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D`` head dim, ``N`` the size of a vmapped dim.

Under :func:`dikkat.core.tracing.tracing` the tiled call is one custom op
(:mod:`dikkat.core.tiled.traced`). For every mask kind — none, causal, sliding window,
padding by lengths and by a valid tensor, packed documents, prefix-LM, a bool tensor, and
combinations with ``&``, ``|`` and ``~`` (rows that see no key included) — and with a bias, a
softcap and sinks: dynamo traces it with no graph break; the compiled output and gradients
match the fp64 reference; vmap equals a loop; jacrev equals autograd's jacobian; gradcheck
passes with batched gradients; and torch.export runs it. Shapes are small: every check runs
the real tiled code on a few tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import dikkat
from dikkat import masks
from dikkat.core import reference_attention
from dikkat.core.masks import Mask
from dikkat.core.tiled import tiled_attention

B, H, G, T, S, D = 2, 2, 1, 5, 7, 4
SCALE = 0.6
LENGTHS = torch.tensor([4, 7])
VALID = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2]])
DENSE = torch.rand(B, 1, T, S, generator=torch.manual_seed(3)) < 0.6


def _bias(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.manual_seed(4))


# name: (mask, extra keyword arguments of tiled_attention)
CASES: dict[str, tuple[Mask | None, dict]] = {
    "none": (None, {}),
    "causal": (masks.causal(), {}),
    "sliding_window": (masks.sliding_window(3), {}),
    "padding_lengths": (masks.padding(LENGTHS), {}),
    "padding_valid": (masks.padding(valid=VALID), {}),
    "document": (masks.document(IDS), {}),
    "prefix_lm": (masks.prefix_lm(torch.tensor([2, 4])), {}),
    "dense": (masks.as_mask(DENSE), {}),
    "and": (masks.causal() & masks.padding(LENGTHS), {}),
    "or": (masks.sliding_window(2) | masks.prefix_lm(2), {}),
    "not": (masks.causal() & ~masks.sliding_window(2), {}),  # rows 0 and 1 see no key
    "bias": (masks.causal(), {"bias": _bias(1, H, T, S)}),
    "softcap": (masks.sliding_window(4), {"softcap": 1.5}),
    "sinks": (masks.padding(LENGTHS), {"sinks": _bias(H)}),
}


def _qkv(dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.manual_seed(seed)
    return tuple(  # type: ignore[return-value]
        torch.randn(*shape, dtype=dtype, generator=g)
        for shape in ((B, H, T, D), (B, G, S, D), (B, G, S, D))
    )


def _fn(
    name: str, dtype: torch.dtype = torch.float64
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    mask, extra = CASES[name]
    extra = {key: t.to(dtype) if isinstance(t, Tensor) else t for key, t in extra.items()}

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return tiled_attention(q, k, v, mask, scale=SCALE, **extra)[0]

    return fn


def _reference(name: str, q: Tensor, k: Tensor, v: Tensor, **extra: Tensor) -> Tensor:
    mask, kwargs = CASES[name]
    kv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    return reference_attention(q, *kv, mask, scale=SCALE, **{**kwargs, **extra})[0]


@pytest.fixture(autouse=True)
def _recompiles():
    # one compiled code object per case: above dynamo's default of 8 recompiles
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        yield


@pytest.mark.parametrize("name", list(CASES))
def test_no_graph_break(name: str) -> None:
    explanation = torch._dynamo.explain(_fn(name, torch.float32))(*_qkv(torch.float32))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_matches_reference(name: str) -> None:
    """Output and the gradients of q, k, v (and of the bias and sinks) of the compiled call,
    against the fp64 reference."""
    mask, extra = CASES[name]
    params = {key: t.float().requires_grad_() for key, t in extra.items() if isinstance(t, Tensor)}
    static = {key: value for key, value in extra.items() if key not in params}

    def fn(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Tensor]) -> Tensor:
        return tiled_attention(q, k, v, mask, scale=SCALE, **static, **params)[0]

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    out = compiled(q, k, v, params)
    assert out.dtype == torch.float32
    w = torch.randn(out.shape, generator=torch.manual_seed(5))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, *params.values()))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p64 = {key: t.detach().double().requires_grad_() for key, t in params.items()}
    want = _reference(name, q64, k64, v64, **p64)
    wants = torch.autograd.grad((want * w.double()).sum(), (q64, k64, v64, *p64.values()))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1  # not trivially equal
    for got, exp in zip(grads, wants, strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_vmap_equals_loop(name: str) -> None:
    fn = _fn(name)
    qs = torch.randn(3, B, H, T, D, dtype=torch.float64, generator=torch.manual_seed(6))
    _, k, v = _qkv()
    got = torch.func.vmap(fn, in_dims=(0, None, None))(qs, k, v)
    want = torch.stack([fn(q, k, v) for q in qs])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_jacrev_equals_jacobian(name: str) -> None:
    fn = _fn(name)
    q, k, v = _qkv()
    got = torch.func.jacrev(lambda x: fn(x, k, v))(q)
    want = torch.autograd.functional.jacobian(lambda x: fn(x, k, v), q)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert want.abs().max() > 0.01


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_batched(name: str) -> None:
    fn = _fn(name)
    inputs = tuple(t.requires_grad_() for t in _qkv())
    assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=True)


class _Model(torch.nn.Module):
    def __init__(self, name: str, entry: Callable[..., Tensor]) -> None:
        super().__init__()
        self.name, self.entry = name, entry

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        mask, extra = CASES[self.name]
        extra = {key: t.to(q.dtype) if isinstance(t, Tensor) else t for key, t in extra.items()}
        return self.entry(q, k, v, mask, **extra)


def _tiled(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, **extra: object) -> Tensor:
    return tiled_attention(q, k, v, mask, scale=SCALE, **extra)[0]  # type: ignore[arg-type]


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, **extra: object) -> Tensor:
    return dikkat.attention(q, k, v, mask=mask, scale=SCALE, backend="tiled", **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["and", "document", "dense", "bias", "sinks", "softcap"])
def test_export(name: str) -> None:
    q, k, v = _qkv(torch.float32)
    model = _Model(name, _tiled)
    program = torch.export.export(model, (q, k, v))
    assert "dikkat.tiled_forward" in str(program.graph)
    torch.testing.assert_close(program.module()(q, k, v), model(q, k, v), rtol=0, atol=0)
    q2, k2, v2 = _qkv(torch.float32, seed=1)  # other inputs of the same shapes
    torch.testing.assert_close(program.module()(q2, k2, v2), model(q2, k2, v2), rtol=0, atol=0)
    # the exported graph holds the op itself: its gradient is the op's registered formula
    grads = []
    for run in (program.module(), model):
        inputs = [t.clone().requires_grad_() for t in (q2, k2, v2)]
        grads.append(torch.autograd.grad(run(*inputs).square().sum(), inputs))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_attention_no_graph_break() -> None:
    q, k, v = _qkv(torch.float32)
    mask = masks.causal() & masks.padding(LENGTHS)
    explanation = torch._dynamo.explain(lambda q, k, v: _attention(q, k, v, mask))(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_attention_export() -> None:
    q, k, v = _qkv(torch.float32)
    model = _Model("and", _attention)
    program = torch.export.export(model, (q, k, v))
    torch.testing.assert_close(program.module()(q, k, v), model(q, k, v), rtol=0, atol=0)


def test_inductor() -> None:
    """One case through inductor, forward and backward, against the fp64 reference."""
    fn = torch.compile(_fn("and", torch.float32), fullgraph=True)
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out.square().sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _reference("and", q64, k64, v64)
    wants = torch.autograd.grad(want.square().sum(), (q64, k64, v64))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, exp in zip((dq, dk, dv), wants, strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-5)


# --- vmap: what folds into the batch, what cannot -------------------------------------------------


def test_vmap_over_everything() -> None:
    """q, k, v, bias and sinks all vmapped (the bias and sinks of batch size 1), forward and
    through jacrev of the bias; against a loop."""
    mask = masks.document(IDS) | masks.padding(LENGTHS)
    n = 2
    g = torch.manual_seed(7)
    qs, ks, vs = (torch.randn(n, *t.shape, dtype=torch.float64, generator=g) for t in _qkv())
    biases = torch.randn(n, 1, H, T, S, dtype=torch.float64, generator=g)
    sinks = torch.randn(n, 1, H, 1, dtype=torch.float64, generator=g)

    def fn(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, sink: Tensor) -> Tensor:
        return tiled_attention(q, k, v, mask, scale=SCALE, bias=bias, sinks=sink)[0]

    got = torch.func.vmap(fn)(qs, ks, vs, biases, sinks)
    want = torch.stack([fn(*args) for args in zip(qs, ks, vs, biases, sinks, strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    jac = torch.func.vmap(torch.func.jacrev(fn, argnums=(3, 4)))(qs, ks, vs, biases, sinks)
    for i in range(n):
        qkv = (qs[i], ks[i], vs[i])
        want_jac = torch.autograd.functional.jacobian(
            functools.partial(fn, *qkv), (biases[i], sinks[i])
        )
        for got_j, want_j in zip((jac[0][i], jac[1][i]), want_jac, strict=True):
            torch.testing.assert_close(got_j, want_j, rtol=1e-10, atol=1e-12)


def test_vmap_nested_with_shared_keys() -> None:
    """Two vmapped dims, keys and values shared by the batch (batch size 1)."""
    mask = masks.prefix_lm(torch.tensor([3, 1]))
    qs = torch.randn(2, 3, B, H, T, D, dtype=torch.float64, generator=torch.manual_seed(8))
    _, k, v = _qkv()
    k, v = k[:1], v[:1]

    def fn(q: Tensor) -> Tensor:
        return tiled_attention(q, k, v, mask, scale=SCALE)[0]

    got = torch.func.vmap(torch.func.vmap(fn))(qs)
    want = torch.stack([torch.stack([fn(q) for q in row]) for row in qs])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_vmap_over_a_mask_tensor_is_refused() -> None:
    q, k, v = _qkv()
    lengths = torch.tensor([[3, 7], [5, 2]])

    def fn(lengths: Tensor) -> Tensor:
        mask = masks.Padding(lengths=lengths)  # padding() reads the lengths: not under vmap
        return tiled_attention(q, k, v, mask, scale=SCALE)[0]

    with pytest.raises(ValueError, match=r"Padding\.lengths"):
        torch.func.vmap(fn)(lengths)


class _EvenRows(Mask):
    """A mask of the caller's own, not a dataclass: batch rows of even index see keys < 3."""

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (b % 2 == 1) | (kv_idx < 3)


@dataclasses.dataclass(frozen=True, eq=False)
class _Band(Mask):
    """A dataclass mask of the caller's own: keys within ``width`` of the row, by batch row."""

    widths: Tensor

    def predicate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() < self.widths[b]


@pytest.mark.parametrize(
    "mask", [_EvenRows(), _Band(torch.tensor([1, 3]))], ids=["object", "dataclass"]
)
def test_callers_own_mask(mask: Mask) -> None:
    """Compiled with no graph break, and vmapped once per entry (folding would change which
    batch row each entry's rows are): a loop's result."""
    q, k, v = _qkv()

    def fn(q: Tensor) -> Tensor:
        return tiled_attention(q, k, v, mask, scale=SCALE)[0]

    explanation = torch._dynamo.explain(fn)(q)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q), fn(q), rtol=0, atol=0)
    qs = torch.randn(3, *q.shape, dtype=q.dtype, generator=torch.manual_seed(9))
    got = torch.func.vmap(fn)(qs)
    torch.testing.assert_close(got, torch.stack([fn(x) for x in qs]), rtol=1e-12, atol=1e-12)


def test_window_width_changes_under_one_compiled_function() -> None:
    """A mask's int fields reach the op as numbers: once dynamo makes a changing width symbolic,
    the compiled function still runs (no graph break, no failure) and follows the width."""
    q, k, v = _qkv()

    def fn(q: Tensor, width: int) -> Tensor:
        return tiled_attention(q, k, v, masks.sliding_window(width), scale=SCALE)[0]

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for width in (2, 3, 4, 6):
        torch.testing.assert_close(compiled(q, width), fn(q, width), rtol=0, atol=0)
    assert not torch.equal(fn(q, 2), fn(q, 6))


def test_the_mask_registry_is_marked_constant_as_torchs_decorator_marks_a_function() -> None:
    """mask_flat marks its registry function for dynamo by hand (importing dynamo to decorate
    it would cost every ``import dikkat`` a second): torch's decorator must still do no more."""
    from dikkat.core import mask_flat

    def probe() -> str:
        return ""

    torch.compiler.assume_constant_result(probe)
    assert probe.__dict__ == {"_dynamo_marked_constant": True}
    assert mask_flat._register.__dict__ == probe.__dict__
