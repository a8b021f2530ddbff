"""A GGUF file's quantised blocks repacked (dikkat.weights.gguf_blocks): bit for bit what the
gguf package's own dequantisation gives, for every block format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dikkat.weights.formats import PACKED_KINDS, repack
from dikkat.weights.packed import dequantize

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
