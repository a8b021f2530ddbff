"""The audits on Hugging Face models: a tiny random Llama passes; the same Llama given an
attention function that drops the mask (registered in ``AttentionInterface`` alone, as a user
might) is caught at its first position.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` tokens, ``D`` head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dikkat import audit

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V, T = 48, 8


def sdpa_without_mask(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """transformers' attention signature, but the mask is never applied: the bug."""
    group = query.shape[1] // key.shape[1]  # H / G
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling)
    return out.transpose(1, 2), None  # (B, T, H, D)


def llama(attn_implementation: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def test_a_llama_is_causal_and_its_cache_decodes_the_full_forward():
    model = llama()
    report = audit.causality(model, V, T)
    assert report.ok and report.unread == (), str(report)
    assert report.checked.jacobian.startswith("through get_input_embeddings()")
    cache = audit.kv_cache(model, seq_len=T)
    assert cache.ok, str(cache)
    positions = audit.permutation(model, torch.randint(0, V, (2, T)), causal=True, expect=False)
    assert positions.ok, str(positions)  # RoPE


def test_an_attention_function_without_a_mask_function_leaks_from_position_0():
    transformers.AttentionInterface.register("audit-test-nomask", sdpa_without_mask)
    report = audit.causality(llama("audit-test-nomask"), V, T)
    assert not report.ok
    assert report.first_leak == (0, 1)
    assert report.leaks == tuple((i, j) for i in range(T) for j in range(i + 1, T))
    assert report.jacobian_leaks == report.leaks
    assert "position 0 depends on the token at 1" in str(report)
