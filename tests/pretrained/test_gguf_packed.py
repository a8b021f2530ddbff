"""A GGUF file's quantised blocks repacked (dikkat.pretrained.gguf_packed): bit for bit what the
gguf package's own dequantisation gives, for every block format; and the real files loaded with
their quantisation kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

import dikkat
from dikkat.layers.packed import dequantize
from dikkat.layers.packed_layers import PackedEmbedding, PackedLinear
from dikkat.pretrained.gguf_packed import PACKED_KINDS, repack

# where each format keeps its fp16 scales (byte offsets in a block): random bytes there could be
# NaN or infinite, so the test writes finite ones
SCALES = {
    "Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
    "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip


def random_blocks(kind: str, rows: int, K: int, seed: int) -> np.ndarray:
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * K // per_block, nbytes), dtype=np.uint8)
    for at in SCALES[kind]:
        d = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def test_every_packed_kind_has_its_scales_listed():
    assert set(SCALES) == set(PACKED_KINDS)


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_repacked_blocks_dequantise_bit_for_bit_as_gguf_does(kind):
    K = 512  # two super-blocks of 256 for the K-quants
    raw = random_blocks(kind, 6, K, seed=len(kind))
    want = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(6, K)
    p = repack(raw, kind, (6, K))
    got = dequantize(p).numpy()
    assert np.array_equal(got, want.astype(np.float32)), np.abs(got - want).max()
    assert p.kind == kind and p.shape == (6, K)
    if kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # their blocks hold fp16 d (and m)
        assert p.scale.dtype == torch.float16, "the file's fp16 scales are kept in fp16"


def test_a_wrong_size_or_kind_is_refused():
    raw = random_blocks("Q4_0", 2, 64, seed=0)
    with pytest.raises(ValueError, match="must be"):
        repack(raw, "Q4_0", (2, 96))
    with pytest.raises(ValueError, match="not packed by dikkat"):
        repack(raw, "IQ2_XS", (2, 64))


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
    monkeypatch.setattr("dikkat.layers.packed._NATIVE", [None])
    assert lm.generate(prompt, 12) == native
