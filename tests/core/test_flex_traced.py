"""The flex backend inside ``torch.compile``, ``torch.export`` and ``torch.func`` transforms.

Under an outer compile dikkat calls torch's ``flex_attention`` itself (dynamo records it as a
higher-order op) with the block mask built in the trace: no graph break. What torch's flex cannot
do there — a CPU backward, a torch.func transform — is refused by name. The compiles here use
dynamo's ``eager`` backend (the graph capture is what is under test); flex's blocks are 128, so
these short calls each fit one block.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dikkat
from dikkat import masks
from dikkat.core import flex

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch.nn.attention.flex_attention") is None,
    reason="torch has no flex_attention",
)

B, H, G, T, S, D = 2, 4, 2, 12, 16, 8
LENGTHS = torch.tensor([5, 16])
DENSE = torch.rand(B, 1, T, S, generator=torch.manual_seed(3)) < 0.6
MASKS = {
    "none": None,
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(4),
    "padding": masks.padding(LENGTHS),
    "bool_tensor": DENSE,
}
BIAS = torch.randn(1, H, T, S, generator=torch.manual_seed(4))
SOFTCAP = 2.0


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.manual_seed(5)
    q = torch.randn(B, H, T, D, generator=gen) * 2
    return q, torch.randn(B, G, S, D, generator=gen) * 2, torch.randn(B, G, S, D, generator=gen)


def _every_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """flex on each mask kind, then with a bias and soft-capping (a score_mod), q_offset 4."""
    outs = [dikkat.attention(q, k, v, m, backend="flex") for m in MASKS.values()]
    outs.append(
        dikkat.attention(
            q, k, v, masks.causal(), bias=BIAS, softcap=SOFTCAP, q_offset=4, backend="flex"
        )
    )
    return outs


def _references(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    q, k, v = q.double(), k.double(), v.double()
    outs = [dikkat.attention(q, k, v, m, backend="reference") for m in MASKS.values()]
    outs.append(
        dikkat.attention(
            q,
            k,
            v,
            masks.causal(),
            bias=BIAS.double(),
            softcap=SOFTCAP,
            q_offset=4,
            backend="reference",
        )
    )
    return outs


def test_compiled_flex_has_no_graph_break_and_equals_the_fp64_reference() -> None:
    # fullgraph=True makes any graph break an error: each mask kind and the score_mod in one graph
    q, k, v = _inputs()
    flex.block_masks.clear()
    flex.compiled.clear()
    compiled = torch.compile(_every_call, backend="eager", fullgraph=True)
    got = compiled(q, k, v)
    assert len(flex.block_masks) == 0 and len(flex.compiled) == 0  # the outer compile owns it all
    exact = _references(q, k, v)
    names = [*MASKS, "bias_softcap"]
    for name, out, ref in zip(names, got, exact, strict=True):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=name)
        assert (ref - ref.mean()).abs().max() > 0.1  # not trivially equal
    # padding: sequence 0 sees keys < 5 only, so changing value row 10 changes only sequence 1
    v2 = v.clone()
    v2[:, :, 10] += 100
    again = compiled(q, k, v2)
    torch.testing.assert_close(again[3][0], got[3][0])
    assert not torch.allclose(again[3][1], got[3][1])


def test_export_of_a_module_calling_flex_equals_the_reference() -> None:
    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dikkat.attention(q, k, v, masks.sliding_window(4), backend="flex")

    q, k, v = _inputs()
    program = torch.export.export(Attend(), (q, k, v))
    got = program.module()(q, k, v)
    ref = _references(q, k, v)[2]
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)


def test_a_cpu_backward_inside_compile_is_refused_by_name() -> None:
    q, k, v = _inputs()
    q.requires_grad_()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dikkat.attention(q, k, v, masks.causal(), backend="flex")

    with pytest.raises(ValueError, match=r"no backward on CPU.*backend='tiled'"):
        torch.compile(step, backend="eager")(q, k, v)
    # without a gradient needed it is served
    with torch.no_grad():
        out = torch.compile(step, backend="eager")(q, k, v)
    torch.testing.assert_close(out.double(), _references(q.detach(), k, v)[1], atol=2e-5, rtol=0)


def test_a_bias_needing_a_gradient_inside_compile_is_refused_by_name() -> None:
    q, k, v = _inputs()
    bias = BIAS.clone().requires_grad_()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dikkat.attention(q, k, v, bias=bias, backend="flex")

    with pytest.raises(ValueError, match=r"bias that needs a gradient.*backend='tiled'"):
        torch.compile(step, backend="eager")(q, k, v)


def test_vmap_over_flex_is_refused_by_name_and_auto_passes_flex_by() -> None:
    q, k, v = (t.unsqueeze(0).repeat(3, 1, 1, 1, 1) for t in _inputs())

    def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
        return dikkat.attention(q, k, v, masks.sliding_window(4), backend=backend)

    with pytest.raises(ValueError, match=r"no rule for torch.func transforms.*'sdpa'"):
        torch.func.vmap(lambda *t: one(*t, "flex"))(q, k, v)
    # the refusal is flex_supports', so auto never picks flex there (it takes sdpa)
    got = torch.func.vmap(lambda *t: one(*t, "auto"))(q, k, v)
    ref = _references(q[1], k[1], v[1])[2]
    torch.testing.assert_close(got[1].double(), ref, atol=2e-5, rtol=2e-5)


def test_jit_trace_is_refused_by_name() -> None:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dikkat.attention(q, k, v, masks.causal(), backend="flex")

    with pytest.raises(ValueError, match=r"torch.jit.trace cannot record.*torch.export"):
        torch.jit.trace(call, _inputs())


def test_the_lse_on_cpu_is_refused_inside_compile_as_outside() -> None:
    q, k, v = _inputs()

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
        return dikkat.attention(q, k, v, masks.causal(), backend="flex", return_lse=True)

    with pytest.raises(ValueError, match="returns no log-sum-exp"):
        torch.compile(call, backend="eager")(q, k, v)


def test_traced_refusal_is_silent_outside_a_trace() -> None:
    q, k, v = _inputs()
    q.requires_grad_()
    # eagerly a CPU backward is served (through the tiled backward): flex_supports asks
    # traced_refusal only inside a trace, where it names the backward
    assert flex.flex_supports(q, k=k, v=v) is None
    assert "no backward on CPU" in flex.traced_refusal(q, k, v)
    assert flex.traced_refusal(q.detach(), k, v) is None
