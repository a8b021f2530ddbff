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


def test_partial_rotary_turns_the_first_features_and_passes_the_rest():
    """RoPE on R of D features (Phi-4-mini): the first R turn as a RoPE of R features would
    turn them; the others pass unchanged."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)
    partial = RotaryEmbedding(8, rotary_dim=4).rotate(x, positions)
    whole = RotaryEmbedding(4).rotate(x[..., :4].contiguous(), positions)
    torch.testing.assert_close(partial[..., :4], whole, atol=1e-12, rtol=0)
    assert torch.equal(partial[..., 4:], x[..., 4:])


def test_longrope_picks_each_row_s_divisors_by_its_last_position():
    """Short divisors while a sequence's last position is below the switch, long ones from it
    on, for every position of that row; cos and sin scaled by mscale."""
    short, long = (1.0, 2.0), (3.0, 5.0)
    rope = RotaryEmbedding(4, factors=short, long_factors=long, switch_at=6, mscale=1.5)
    positions = torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]])  # the second row reaches the switch
    cos, sin = rope.angles(positions, torch.float64)
    base = 10000.0 ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    for row, divisors in ((0, short), (1, long)):
        angles = positions[row, :, None].double() * base / torch.tensor(divisors)
        torch.testing.assert_close(cos[row, 0], 1.5 * angles.cos(), atol=1e-12, rtol=0)
        torch.testing.assert_close(sin[row, 0], 1.5 * angles.sin(), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="long_factors and switch_at go together"):
        RotaryEmbedding(4, long_factors=long)
    with pytest.raises(ValueError, match="rotary_dim must be even and at most head_dim 4"):
        RotaryEmbedding(4, rotary_dim=6)
