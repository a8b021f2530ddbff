"""Position information: without it attention cannot see order (docs/contract.md §8).

Notation: ``B`` batch, ``H`` heads, ``T`` length, ``D`` head dim, ``C`` model width.

Two families (docs/contract.md §8): vectors *added* to x before the first layer (sinusoidal,
learned), and position acting *inside* attention on q and k (RoPE rotates them; ALiBi adds a
distance penalty to the scores). The second kind is injected into :class:`MultiHeadAttention`.

Positions are absolute token indices: an int ``offset`` (first position, for decoding with a KV
cache) or an explicit integer tensor ``positions`` of shape (T,) or (B, T).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from dikkat.core.tracing import check_traced, tracing
from dikkat.validate import check_bool, check_float, check_int

__all__ = [
    "ALiBi",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "alibi_slopes",
    "as_rope_factors",
    "llama3_rope_factors",
    "resolve_positions",
    "rotate_half",
    "sinusoidal_table",
    "valid_positions",
]


def resolve_positions(
    T: int, offset: int = 0, positions: Tensor | None = None, device: torch.device | None = None
) -> Tensor:
    """Integer positions (T,) or (B, T): ``positions`` if given, else ``offset … offset+T−1``."""
    if positions is None:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        return torch.arange(offset, offset + T, device=device)
    if (
        not isinstance(positions, Tensor)
        or positions.dtype.is_floating_point
        or positions.dtype == torch.bool  # a bool tensor would index as a mask, not positions
    ):
        raise TypeError("positions must be an integer tensor of shape (T,) or (B, T)")
    if positions.dim() not in (1, 2) or positions.shape[-1] != T:
        raise ValueError(
            f"positions must have shape (T,) or (B, T) with T={T}, got {tuple(positions.shape)}"
        )
    return positions


def valid_positions(valid: Tensor) -> Tensor:
    """Positions (B, T) of a padded batch from ``valid`` (B, T) (False = padding): each real
    token's index among the real tokens of its row, so a left-padded row is positioned as it
    would be alone; a pad takes the position of the real token before it (or 0)."""
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
        got = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, Tensor) else type(valid)
        raise TypeError(f"valid must be a (B, T) bool tensor, got {got}")
    return (valid.long().cumsum(-1) - 1).clamp_min(0)


def _check_max_len(pos: Tensor, max_len: int, what: str) -> None:
    if tracing():  # torch.compile, export, vmap: the values cannot reach Python here
        ok = ((pos >= 0) & (pos < max_len)).all()
        check_traced(ok, f"{what} holds positions 0 … {max_len - 1}, got others")
        return
    if pos.numel() and (int(pos.max()) >= max_len or int(pos.min()) < 0):
        raise ValueError(
            f"{what} holds positions 0 … {max_len - 1}, got positions {int(pos.min())} … "
            f"{int(pos.max())}"
        )


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """(max_len, d): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same angle)."""
    check_int("max_len", max_len)
    check_int("d_model", d_model)
    if d_model % 2:
        raise ValueError(f"sinusoidal encoding needs an even d_model, got {d_model}")
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(
        -math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
    )  # (d/2,)
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """The original paper's fixed sin/cos vectors, added to x (B, T, C). No parameters."""

    def __init__(self, d_model: int, max_len: int = 4096) -> None:
        super().__init__()
        self.d_model, self.max_len = d_model, max_len
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        pos = resolve_positions(x.shape[1], offset, positions, x.device)
        _check_max_len(pos, self.max_len, "SinusoidalPositionalEncoding")
        return x + self.table[pos].to(x.dtype)  # (T, C) or (B, T, C), broadcast over B


class LearnedPositionalEmbedding(nn.Module):
    """One learned vector per position (GPT-2, BERT), added to x (B, T, C)."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        check_int("max_len", max_len)
        check_int("d_model", d_model)
        self.max_len = max_len
        # the draws of torch.randn(...) * 0.02, as an init that a model built on the meta
        # device skips (dikkat.models.io.meta_modules)
        self.weight = nn.Parameter(nn.init.normal_(torch.empty(max_len, d_model), std=0.02))

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        pos = resolve_positions(x.shape[1], offset, positions, x.device)
        _check_max_len(pos, self.max_len, "LearnedPositionalEmbedding")
        return x + self.weight[pos].to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate pairs of q/k features by an angle proportional to the position.

    The score q_i · k_j then depends on content and on i − j only. Pairs are (x[:D/2], x[D/2:])
    (the "rotate half" layout of GPT-NeoX and LLaMA). Applied inside attention, after the
    projections, to q (B, H, T, D) and k (B, G, S, D).
    """

    # filled by each call (the last positions' table), not part of the layer: what describes
    # the layer leaves it out (dikkat.models.aot_step)
    made_on_use: ClassVar[tuple[str, ...]] = ("_table",)

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        max_len: int = 4096,
        factors: Sequence[float] | None = None,
        rotary_dim: int | None = None,
        long_factors: Sequence[float] | None = None,
        switch_at: int | None = None,
        mscale: float = 1.0,
    ) -> None:
        super().__init__()
        check_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        # base^(−2i/D): a base ≤ 0 gives NaN (or infinite) frequencies, NaN in every score
        check_float("base", base, low=0.0, low_open=True)
        check_int("max_len", max_len)
        check_int("rotary_dim", rotary_dim, optional=True)
        rot = head_dim if rotary_dim is None else rotary_dim
        if rot % 2 or rot > head_dim:
            raise ValueError(f"rotary_dim must be even and at most head_dim {head_dim}, got {rot}")
        check_float("mscale", mscale, low=0.0, low_open=True)
        self.head_dim, self.base, self.max_len, self.rotary_dim = head_dim, base, max_len, rot
        # A plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round the
        # frequencies. Angles are computed in float64 for the positions of each call.
        # On the CPU even inside `with torch.device("meta")` (a model built there to be loaded
        # with assign=True keeps working frequencies); moved to the positions' device per call.
        steps = torch.arange(0, rot, 2, dtype=torch.float64, device="cpu")
        unscaled = base ** (-steps / rot)
        # RoPE scaling: frequency i divided by factors[i] (llama.cpp's rope_freqs tensor,
        # ggml_rope_ext's freq_factors; linear scaling divides each by one factor)
        self.factors = None if factors is None else as_rope_factors(factors, rot)
        self.inv_freq = unscaled if self.factors is None else unscaled / _tensor(self.factors)
        # LongRoPE (Ding et al. 2024, arXiv:2402.13753; Phi-3's long-context models): a sequence
        # whose last position is switch_at or more turns by long_factors instead, as
        # transformers' longrope rule picks them; cos and sin scaled by mscale
        if (long_factors is None) != (switch_at is None):
            raise ValueError("long_factors and switch_at go together (LongRoPE)")
        check_int("switch_at", switch_at, optional=True)
        self.switch_at, self.mscale = switch_at, mscale
        self.long_factors = None if long_factors is None else as_rope_factors(long_factors, rot)
        self.long_inv_freq = (
            None if self.long_factors is None else unscaled / _tensor(self.long_factors)
        )
        # the last positions' cos and sin: the layers of one forward pass share one positions
        # tensor (a model that passes it to every layer computes the table once, not per layer)
        self._table: tuple[Tensor, int | None, torch.dtype, Tensor, Tensor] | None = None

    def angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles at integer ``positions`` (T,) or (B, T), in ``dtype``:
        (T, D/2), or (B, 1, T, D/2) (the same for every head) — what :func:`rotate_half` turns
        q and k by. RoPE's one entry: :class:`~dikkat.layers.MultiHeadAttention` asks it once
        for q and k of every step, eager or compiled.

        The positions are checked against ``max_len`` (read on the host; inside a traced graph
        a device-side assert, see :func:`dikkat.core.tracing.check_traced`). Eagerly the table
        is kept for the same positions tensor, unchanged since (its version counter; an
        inference tensor has none, so a model calls :meth:`forget` before each pass), and
        dtype: the layers of one pass, given one positions tensor, compute it once. Traced,
        nothing is kept (a graph holds no state between calls)."""
        if tracing():
            _check_max_len(positions, self.max_len, "RotaryEmbedding")
            return self._angles(positions, dtype)
        version = None if positions.is_inference() else positions._version
        table = self._table
        if table is not None and table[0] is positions and table[1:3] == (version, dtype):
            return table[3], table[4]
        _check_max_len(positions, self.max_len, "RotaryEmbedding")
        cos, sin = self._angles(positions, dtype)
        self._table = (positions, version, dtype, cos, sin)
        return cos, sin

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, T, D) at integer positions (T,) or (B, T) → rotated x, same shape and dtype:
        :func:`rotate_half` by :meth:`angles`."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE built for head_dim {self.head_dim}, got x of shape {tuple(x.shape)}"
            )
        cos, sin = self.angles(positions, x.dtype)
        return rotate_half(x, cos, sin)

    def _angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        if self.long_inv_freq is not None:  # each row's own pick, by its last position
            long = positions.amax(dim=-1, keepdim=True).unsqueeze(-1) >= self.switch_at
            inv_freq = torch.where(long, self.long_inv_freq.to(positions.device), inv_freq)
        angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # (T, R/2) or (B, T, R/2)
        if positions.dim() == 2:
            angles = angles.unsqueeze(1)  # (B, 1, T, R/2): the same for every head
        cos, sin = angles.cos(), angles.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        return cos.to(dtype), sin.to(dtype)

    def forget(self) -> None:
        """Drop the kept table (a new forward pass begins)."""
        self._table = None

    def extra_repr(self) -> str:
        scaled = "" if self.factors is None else f", factors={_shown_factors(self.factors)}"
        if self.rotary_dim != self.head_dim:
            scaled += f", rotary_dim={self.rotary_dim}"
        if self.long_factors is not None:
            scaled += (f", long_factors={_shown_factors(self.long_factors)}, "
                       f"switch_at={self.switch_at}, mscale={self.mscale}")  # fmt: skip
        return f"head_dim={self.head_dim}, base={self.base}, max_len={self.max_len}{scaled}"


def _tensor(values: Sequence[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64, device="cpu")


def as_rope_factors(factors: Sequence[float], head_dim: int) -> tuple[float, ...]:
    """RoPE scaling's ``factors`` (one divisor per frequency) as a tuple of D/2 positive finite
    floats, or a ValueError naming them."""
    values = tuple(float(f) for f in factors)
    if len(values) != head_dim // 2:
        raise ValueError(
            f"factors must give one divisor per frequency, {head_dim // 2} for head_dim "
            f"{head_dim}; got {len(values)}"
        )
    bad = [f for f in values if not (math.isfinite(f) and f > 0)]
    if bad:
        raise ValueError(f"factors must be positive and finite, got {bad[:4]}")
    return values


def _shown_factors(factors: tuple[float, ...]) -> str:
    """A short, exact name of a factor list: one value, or its range and a digest of all."""
    if len(set(factors)) == 1:
        return f"{factors[0]}"
    digest = hashlib.sha256(repr(factors).encode()).hexdigest()[:8]
    return f"{min(factors)}..{max(factors)} (#{digest})"


def llama3_rope_factors(
    head_dim: int,
    base: float,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_len: int,
) -> tuple[float, ...]:
    """The divisor of each RoPE frequency under Llama 3.1's scaling (Meta's ``apply_scaling`` in
    llama-models, transformers' ``rope_type="llama3"``): a frequency whose wavelength is under
    ``original_max_len / high_freq_factor`` is kept, one over ``original_max_len /
    low_freq_factor`` divided by ``factor``, and those between by a blend that moves smoothly
    from one to the other — the values llama.cpp's converter writes as the ``rope_freqs`` tensor.
    """
    check_int("head_dim", head_dim)
    check_float("base", base, low=0.0, low_open=True)
    check_float("factor", factor, low=0.0, low_open=True)
    check_int("original_max_len", original_max_len)
    if not 0 < low_freq_factor < high_freq_factor:
        raise ValueError(
            f"need 0 < low_freq_factor < high_freq_factor, got {low_freq_factor} and "
            f"{high_freq_factor}"
        )
    low_wavelen = original_max_len / low_freq_factor  # longer waves than this: divided
    high_wavelen = original_max_len / high_freq_factor  # shorter waves than this: kept
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:  # 1 / the blend of 1/factor and 1 that the reference applies to the frequency
            smooth = (original_max_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi head slopes: the geometric sequence 2^(−8/n), 2^(−16/n), … for n a power of two;
    otherwise those of the nearest lower power of two, then every other slope of the next one."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    check_int("n_heads", n_heads)
    lower = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(lower)
    if lower != n_heads:
        slopes += power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes)


class ALiBi(nn.Module):
    """ALiBi: score(i, j) −= slope_h · (i − j), a penalty that grows with distance.

    Produces an additive bias for :func:`dikkat.attention`. Keys after the query (j > i) get a
    positive term; models that use ALiBi pair it with a causal mask, encoders use |i − j|.
    """

    def __init__(self, n_heads: int, *, symmetric: bool = False) -> None:
        super().__init__()
        check_bool("symmetric", symmetric)
        self.n_heads, self.symmetric = n_heads, symmetric
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """q positions (T,) or (B, T), key positions (S,) or (B, S) → bias (1 or B, H, T, S)."""
        qp = q_positions if q_positions.dim() == 2 else q_positions.unsqueeze(0)
        kp = k_positions if k_positions.dim() == 2 else k_positions.unsqueeze(0)
        distance = (qp.unsqueeze(-1) - kp.unsqueeze(-2)).float()  # (B, T, S)
        if self.symmetric:
            distance = distance.abs()
        return -self.slopes.view(1, -1, 1, 1) * distance.unsqueeze(1)  # (B, H, T, S)


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (…, D) with each pair (x[j], x[D/2 + j]) rotated by the angle of cos, sin (…, D/2).
    Narrower angles (…, R/2), R < D, turn the first R features so and pass the rest (partial
    rotary: Phi-4-mini, GPT-NeoX)."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate_half(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
