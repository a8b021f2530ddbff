"""What self-attention over a detector's feature map costs, stride by stride, beside a 3×3 conv.

A detector looks at an ``imgsz × imgsz`` image through feature maps at strides 8, 16 and 32
(80×80, 40×40, 20×20 at 640). Attention over a map makes every pixel a token, so its score matrix
has ``heads · N²`` cells: 16× more tokens (stride 8 vs 32) means 256× more cells. A 3×3
convolution grows only with N. That is why YOLO26 runs its attention (``C2PSA``) at stride 32
alone, where N = 400.

The attention is :class:`dikkat.vision.psa.Attention`'s: ``heads`` heads of ``hd = C / heads``
value channels and ``kd = int(hd · attn_ratio)`` query/key channels. FLOPs count a multiply-add
as 2 (the convention of ``torch.utils.flop_counter``); memory is in bytes at ``dtype_bytes``
(4 = fp32), one image.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STRIDES", "StrideCost", "format_cost_table", "vision_cost"]

STRIDES = (8, 16, 32)


@dataclass(frozen=True)
class StrideCost:
    """One feature map's attention and 3×3-convolution cost (one image)."""

    stride: int
    side: int  # the map is side × side
    width: int  # channels C
    heads: int
    key_dim: int  # kd, per head
    head_dim: int  # hd, per head (values)
    dtype_bytes: int

    @property
    def tokens(self) -> int:
        """N = side²: one token per pixel."""
        return self.side * self.side

    @property
    def score_cells(self) -> int:
        """heads · N²: one score per (head, query, key)."""
        return self.heads * self.tokens**2

    @property
    def attention_flops(self) -> int:
        """Scores q·kᵀ (2·kd per cell) and the weighted sum of values (2·hd per cell)."""
        return self.score_cells * 2 * (self.key_dim + self.head_dim)

    @property
    def block_flops(self) -> int:
        """The whole attention block: the above plus its 1×1 qkv and proj convolutions and the
        3×3 depthwise positional convolution ``pe``."""
        C, N = self.width, self.tokens
        qkv = 2 * N * C * (C + 2 * self.heads * self.key_dim)
        proj = 2 * N * C * C
        pe = 2 * N * C * 9
        return self.attention_flops + qkv + proj + pe

    @property
    def score_bytes(self) -> int:
        """The (heads, N, N) score matrix the plain formula holds."""
        return self.score_cells * self.dtype_bytes

    @property
    def conv_flops(self) -> int:
        """A 3×3 convolution C → C at stride 1 over the same map."""
        return 2 * 9 * self.width * self.width * self.tokens

    @property
    def conv_bytes(self) -> int:
        """The convolution's output map (C, side, side)."""
        return self.width * self.tokens * self.dtype_bytes


def vision_cost(
    imgsz: int = 640,
    width: int = 128,
    heads: int | None = None,
    *,
    attn_ratio: float = 0.5,
    strides: tuple[int, ...] = STRIDES,
    dtype_bytes: int = 4,
) -> list[StrideCost]:
    """The cost at each stride of an ``imgsz`` image (``heads`` default: ``max(width // 64, 1)``,
    as C2PSA chooses). The default ``width`` 128 is what a 256-channel C2PSA (the nano models')
    attends over: half its channels."""
    for name, value in (("imgsz", imgsz), ("width", width), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for stride in sorted(strides, reverse=True):
        if imgsz % stride:
            raise ValueError(f"imgsz {imgsz} is not a multiple of stride {stride}")
    heads = max(width // 64, 1) if heads is None else heads
    if heads < 1 or width % heads:
        raise ValueError(f"heads {heads} does not divide width {width}")
    head_dim = width // heads
    key_dim = int(head_dim * attn_ratio)
    if key_dim < 1:
        raise ValueError(f"width {width} / heads {heads} leaves key dim int({head_dim}·0.5) = 0")
    return [
        StrideCost(s, imgsz // s, width, heads, key_dim, head_dim, dtype_bytes) for s in strides
    ]


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _bytes(n: int) -> str:
    for factor, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n} B"


def format_cost_table(rows: list[StrideCost], imgsz: int) -> str:
    """The table ``dikkat vision-cost`` prints."""
    r0 = rows[0]
    lines = [
        f"attention over a {imgsz}×{imgsz} image's feature maps: width C = {r0.width}, "
        f"{r0.heads} head(s), key dim {r0.key_dim}, value dim {r0.head_dim}; "
        f"{r0.dtype_bytes}-byte floats, one image",
        "",
    ]
    header = (
        "stride",
        "map",
        "tokens N",
        "score cells",
        "attn FLOPs",
        "attn block",
        "scores mem",
        "3×3 conv",
        "conv map",
        "FLOPs ratio",
        "mem ratio",
    )
    table = [header]
    for r in rows:
        table.append(
            (
                str(r.stride),
                f"{r.side}×{r.side}",
                f"{r.tokens:,}",
                f"{r.score_cells:,}",
                _si(r.attention_flops, "FLOP"),
                _si(r.block_flops, "FLOP"),
                _bytes(r.score_bytes),
                _si(r.conv_flops, "FLOP"),
                _bytes(r.conv_bytes),
                f"{r.attention_flops / r.conv_flops:.2f}×",
                f"{r.score_bytes / r.conv_bytes:.0f}×",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    lines += [
        "",
        "attn FLOPs: scores and weighted values (the N² part); attn block adds its qkv, proj "
        "and pe convolutions;",
        "3×3 conv: FLOPs of a C → C 3×3 convolution, conv map: its output; ratios: attn "
        "FLOPs / conv FLOPs and scores / conv map.",
        "Tokens grow 4× per halving of the stride, score cells 16×: attention is affordable at "
        "stride 32 (YOLO26's C2PSA) and not below.",
    ]
    return "\n".join(lines)
