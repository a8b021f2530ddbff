"""A model holds what a loader hands it (dikkat/models/holding.py): fused q/k/v and gate/up
layers of a file's packed blocks, views rebuilt around them, and the biases of packed q/k/v
(a Qwen2 GGUF file's) loaded with the fused layer."""

from __future__ import annotations

import types

import numpy as np
import pytest
import tiny_gguf as tg
import torch

import dikkat
from dikkat.layers.linear import LinearRows
from dikkat.weights.packed_layers import PackedLinear

pytest.importorskip("gguf")


def qwen2_file(path) -> None:
    """The tiny Llama of tiny_gguf.py as a Qwen2: its keys renamed, q/k/v biases added."""
    keys, tensors = tg.tiny_llama()
    for k in keys:
        k.name = "qwen2." + k.name.removeprefix("llama.") if k.name.startswith("llama.") else k.name
        if k.name == "general.architecture":
            k.value = "qwen2"
    rng, D = np.random.default_rng(5), tg.WIDTH // tg.HEADS
    for i in range(tg.LAYERS):
        for name, heads in (("attn_q", tg.HEADS), ("attn_k", tg.KV_HEADS), ("attn_v", tg.KV_HEADS)):
            b = (0.1 * rng.standard_normal(heads * D)).astype(np.float32)
            tensors.append(tg.Tensor(f"blk.{i}.{name}.bias", tg.T_F32, b.shape, b.tobytes()))
    path.write_bytes(tg.write(keys, tensors)[0])


def test_packed_qkv_with_biases_is_one_fused_layer(tmp_path):
    path = tmp_path / "qwen2.gguf"
    qwen2_file(path)
    packed = dikkat.pretrained.load(path).model
    dense = dikkat.pretrained.load(path, weights="fp32").model
    attn, mlp = packed.blocks[0].attn, packed.blocks[0].mlp
    assert isinstance(attn.qkv_proj, PackedLinear) and attn.qkv_proj.bias is not None
    assert isinstance(attn.k_proj, LinearRows) and attn.k_proj.source is attn.qkv_proj
    assert isinstance(mlp.gate_up, PackedLinear) and mlp.up.source is mlp.gate_up
    assert torch.equal(attn.qkv_proj.bias, dense.blocks[0].attn.qkv_proj.bias)
    ids = torch.tensor([tg.prompt_ids()])
    with torch.no_grad():  # the packed product rounds activations to 16 bits a block of 32
        want = dense(ids)
        torch.testing.assert_close(packed(ids), want, rtol=0, atol=1e-3 * want.abs().max())


def test_a_fused_layer_of_the_wrong_size_is_refused():
    from dikkat.layers import MultiHeadAttention
    from dikkat.layers.linear import Linear
    from dikkat.layers.mlp import GatedMLP

    with pytest.raises(ValueError, match="q/k/v layer must be"):
        MultiHeadAttention(16, 2).hold_qkv(Linear(16, 40))
    with pytest.raises(ValueError, match="gate/up layer must be"):
        GatedMLP(16, 24).hold_gate_up(Linear(16, 24))


def test_hold_consumes_what_it_is_given_and_refuses_a_copy_it_cannot_consume(tmp_path):
    """A loader's dict loses each packed weight as a layer takes it (what was read is let go
    layer by layer); a mapping that cannot be emptied is refused."""
    from dikkat.models import Decoder, DecoderConfig
    from dikkat.models.holding import HoldsWeights
    from dikkat.models.io import meta_modules
    from dikkat.weights.packed import PackedWeight

    path = tmp_path / "tiny.gguf"
    tg.tiny_llama_file(path)
    given: dict = {}
    original = HoldsWeights.hold

    def spy(self, weights, source):
        given["before"] = sum(isinstance(w, PackedWeight) for w in weights.values())
        original(self, weights, source)
        given["after"] = sum(isinstance(w, PackedWeight) for w in weights.values())

    HoldsWeights.hold = spy  # type: ignore[method-assign]
    try:
        dikkat.pretrained.load(path)
    finally:
        HoldsWeights.hold = original  # type: ignore[method-assign]
    assert given["before"] > 0 and given["after"] == 0
    with meta_modules():
        model = Decoder(DecoderConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(TypeError, match="weights must be a dict"):
        model.hold(types.MappingProxyType({}), "here")  # type: ignore[arg-type]
