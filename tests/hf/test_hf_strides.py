"""A Hugging Face model whose attention layers hand dikkat keys in another memory layout: the same
logits and gradients as transformers' eager attention, on the tiled backend (the one whose fused
CPU kernel once read such keys wrongly, docs/attention.md "tiled").

Notation: ``B`` batch, ``T`` tokens, ``V`` vocabulary, ``C`` model width.

A tiny randomly initialised Llama (nothing downloaded) whose key projections return their
output column-major (B, T, C) — stored (B, C, T), as a projection computed as (W xᵀ)ᵀ would be —
so that the keys reach the attention function with a strided last dim. Run without a cache: a
cache concatenates the keys, and the copy is contiguous.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import dikkat.hf
import dikkat.hf.attention

transformers = pytest.importorskip("transformers")

NAME = dikkat.hf.register("dikkat-test-strides-tiled", backend="tiled")
B, T, V = 2, 12, 97
TOL = 1e-5


class ColumnMajor(nn.Module):
    """``inner``'s output with the same values, its last two dims swapped in memory."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x).transpose(-1, -2).contiguous().transpose(-1, -2)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.k_proj = ColumnMajor(layer.self_attn.k_proj)
    return model


def _key_strides(monkeypatch) -> list[tuple[int, ...]]:
    """The strides of every key dikkat's attention function receives from now on."""
    seen: list[tuple[int, ...]] = []
    attention = dikkat.hf.attention.attention

    def spy(q: Tensor, k: Tensor, *args, **kwargs):
        seen.append(k.stride())
        return attention(q, k, *args, **kwargs)

    monkeypatch.setattr(dikkat.hf.attention, "attention", spy)
    return seen


def _loss_grads(model: nn.Module, ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def test_strided_keys_give_eager_logits_and_gradients(monkeypatch) -> None:
    model = _llama().train()  # no dropout in the config: train mode only asks for gradients
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("eager")
    want_logits, want = _loss_grads(model, ids)
    seen = _key_strides(monkeypatch)
    model.set_attn_implementation(NAME)
    got_logits, got = _loss_grads(model, ids)
    assert len(seen) == model.config.num_hidden_layers
    assert all(stride[-1] != 1 for stride in seen), seen  # the keys came strided
    assert float(want_logits.abs().max()) > 0.01  # not a comparison of two zeros
    assert float((got_logits - want_logits).abs().max()) <= TOL
    assert got.keys() == want.keys() and len(want) > 10
    for key in want:
        scale = max(1.0, float(want[key].abs().max()))
        assert float((got[key] - want[key]).abs().max()) <= TOL * scale, key
