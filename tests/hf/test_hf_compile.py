"""A Hugging Face model with ``attn_implementation="dikkat"`` compiles as one graph
(``torch.compile(fullgraph=True)``) and gives its eager logits (docs/hf.md).

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary.

A tiny randomly initialised ``LlamaForCausalLM`` (2 layers, hidden 64, 4 query heads and 2
key/value heads, T = 16; nothing downloaded), float32. The compile uses the ``aot_eager``
backend: dynamo's tracing and AOTAutograd, where graph breaks arise, without inductor's code
generation (seconds instead of a minute). Eager dikkat is itself checked against transformers'
eager attention in float64, so that "compiled equals eager" compares two right answers.
A padding ``attention_mask`` compiles as one graph too.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import dikkat.hf

transformers = pytest.importorskip("transformers")

NAME = dikkat.hf.register()  # "dikkat", backend auto
TOL = 1e-5
B, T, V = 2, 16, 101


def llama(attn: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation(attn)
    return model


def ids() -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    return model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)


@pytest.fixture(scope="module")
def eager() -> Tensor:
    """dikkat's eager float32 logits, checked against transformers' eager attention in fp64."""
    with torch.no_grad():
        ours = logits(llama(NAME), ids())
        oracle = logits(llama("eager", torch.float64), ids())
    assert ours.abs().max() > 0.1  # not trivially equal
    torch.testing.assert_close(ours.double(), oracle, rtol=0, atol=TOL)
    return ours


def test_compiles_fullgraph_to_eager_logits(eager: Tensor) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(llama(NAME), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = logits(compiled, ids())
    torch.testing.assert_close(out, eager, rtol=0, atol=TOL)


def test_explain_finds_no_graph_break() -> None:
    torch._dynamo.reset()
    model, batch = llama(NAME), ids()
    with torch.no_grad():
        explained = torch._dynamo.explain(lambda: logits(model, batch))()
    reasons = [b.reason for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


def test_compiles_fullgraph_with_padding() -> None:
    torch._dynamo.reset()
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, :5] = 0  # the second row left-padded
    model = llama(NAME)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = logits(compiled, ids(), attention_mask)
        want = logits(model, ids(), attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(out[real], want[real], rtol=0, atol=TOL)
