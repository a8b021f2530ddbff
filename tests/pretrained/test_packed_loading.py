"""The real GGUF files loaded with their quantisation kept (dikkat.weights.gguf_blocks repacks
their blocks), and multiplied in PyTorch operations where there is no native kernel."""

from __future__ import annotations

import pytest
import torch

import dikkat
from dikkat.weights import PackedEmbedding, PackedLinear


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request):
    path = request.getfixturevalue(f"{request.param}_gguf")
    return path, dikkat.pretrained.load(path)


def test_a_real_file_loads_its_quantised_matrices_packed(real):
    """Every linear layer packed (q/k/v in one layer, gate and up in another), the token
    embedding packed and shared with a tied output; what the weights hold is at most 1.25 times
    the file."""
    path, lm = real
    model = lm.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert isinstance(model.tok_emb, PackedEmbedding)
    assert model.lm_head.parts[0] is model.tok_emb.packed  # tied: one table
    c = model.config
    assert len(linears) == 4 * c.n_layers + 1  # q/k/v, out, gate/up, down; the head
    for block in model.blocks:
        mlp = block.mlp
        assert mlp.gate.source is mlp.gate_up and mlp.up.source is mlp.gate_up
    held = (
        model.tok_emb.packed.nbytes
        + sum(m.nbytes for m in linears if m is not model.lm_head)
        + sum(p.numel() * p.element_size() for p in model.parameters())
    )
    assert held <= 1.25 * path.stat().st_size, (held, path.stat().st_size)


def test_packed_weights_run_on_the_cpu_in_fp32_only(smollm2_gguf):
    with pytest.raises(ValueError, match="weights='fp32'"):
        dikkat.pretrained.load(smollm2_gguf, dtype=torch.bfloat16)


def test_the_pytorch_product_gives_the_native_kernel_s_tokens(smollm2_gguf, monkeypatch):
    """Without a compiler the same product runs in PyTorch operations: the same greedy tokens."""
    lm = dikkat.pretrained.load(smollm2_gguf)
    prompt = "def fibonacci(n):"
    native = lm.generate(prompt, 12)
    monkeypatch.setattr("dikkat.weights.packed._NATIVE", [None])
    assert lm.generate(prompt, 12) == native
