"""RoPE scaling's divisors (dikkat.layers.llama3_rope_factors, RotaryEmbedding's ``factors``):
Llama 3.1's scaled frequencies against Meta's reference formula written out here in fp64, and
settings that make no scaling refused. (The rotation by scaled frequencies:
tests/layers/test_positional.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from dikkat import RotaryEmbedding
from dikkat.layers import llama3_rope_factors


def meta_llama3_frequencies(
    D: int, base: float, factor: float, low: float, high: float, old: int
) -> list[float]:
    """Llama 3.1's scaled frequencies as Meta's reference scales them (llama-models,
    ``apply_scaling``), written out here on the frequencies themselves in float64."""
    scaled = []
    for i in range(0, D, 2):
        freq = base ** (-i / D)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            scaled.append(freq)
        elif wavelen > old / low:
            scaled.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return scaled


def test_llama3_factors_give_the_reference_frequencies():
    """Llama 3.1 8B's settings: 64 frequencies, every regime (kept, blended, divided) taken."""
    settings = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
    factors = llama3_rope_factors(128, 500000.0, **settings)
    assert {f == 1.0 for f in factors} == {True, False} and max(factors) == 8.0
    assert any(1.0 < f < 8.0 for f in factors)
    rope = RotaryEmbedding(128, base=500000.0, factors=factors)
    want = meta_llama3_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(
        rope.inv_freq, torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=0
    )


def test_rope_scaling_settings_are_checked():
    with pytest.raises(ValueError, match="one divisor per frequency, 4 for head_dim 8; got 3"):
        RotaryEmbedding(8, factors=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"positive and finite, got \[0.0, nan\]"):
        RotaryEmbedding(8, factors=[1.0, 0.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match=r"low_freq_factor < high_freq_factor, got 4\.0 and 1\.0"):
        llama3_rope_factors(
            8, 1e4, factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_len=64
        )
