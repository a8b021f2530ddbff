"""The YOLO PSA family: convolutional blocks with self-attention over the pixels of a feature map.

These are the blocks YOLO11 and YOLO26 use (``C2PSA`` after the backbone, the attention-enabled
``C3k2`` in YOLO26's neck), written so that the math and the state-dict names are those of
``ultralytics==8.4.190``: a state dict taken from one of their blocks loads here with
``load_state_dict(strict=True)`` and gives the same output. The attention itself runs through
:func:`dikkat.attention`, so any of its backends can serve it (``backend=`` on every block
that holds attention; q and k are narrower than v, which every backend accepts).

Notation: ``B`` batch, ``C`` channels, ``H``/``W`` the map's height and width, ``N = H·W`` the
tokens (one per pixel), ``nh`` heads, ``kd`` key dim per head, ``hd`` value (head) dim per head.

Names. State-dict compatibility forces Ultralytics' short names for arguments and submodules:

- ``c1`` input channels, ``c2`` output channels, ``c`` hidden channels (``int(c2 · e)``);
- ``e`` expansion ratio, ``n`` how many blocks to stack, ``k`` kernel size, ``s`` stride,
  ``g`` convolution groups, ``act`` whether to apply SiLU;
- ``cv1``/``cv2`` the block's first and last convolutions, ``m`` the stack of inner blocks,
  ``conv``/``bn`` a :class:`Conv`'s convolution and batch norm, ``qkv``/``proj``/``pe`` the
  attention's projections and its depthwise positional convolution, ``ffn`` the feed-forward pair.

Everything below is ``Conv`` (conv → BN → SiLU) composed; the only attention is in
:class:`Attention`, where ``kd = int(hd · attn_ratio)``: queries and keys are narrower than values.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dikkat.core.attention import attention, check_backend_name
from dikkat.layers.inputs import check_meets
from dikkat.validate import check_bool, check_float, check_int

__all__ = ["C2PSA", "Attention", "Bottleneck", "C3k2", "Conv", "PSABlock"]

BN_EPS = 1e-3  # Ultralytics sets these on every BatchNorm2d when it builds a model
BN_MOMENTUM = 0.03


def _ratio(name: str, value: float) -> None:
    """An expansion or attention ratio: a finite number > 0 (what it leaves is checked after)."""
    check_float(name, value, low=0.0, low_open=True)


def _check_map(x: Tensor, channels: int, block: str) -> None:
    """A feature map (B, C, H, W) with the channels the block was built for."""
    if not isinstance(x, Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{block} takes a feature map (B, C, H, W), got {shape}")
    if x.shape[1] != channels:
        raise ValueError(
            f"{block} was built for {channels} input channels, got x of shape {tuple(x.shape)}"
        )


class Conv(nn.Module):
    """``Conv2d`` (no bias, 'same' padding ``k // 2``) → ``BatchNorm2d`` → SiLU (or identity).

    >>> Conv(16, 32, k=3, s=2)(torch.randn(1, 16, 20, 20)).shape
    torch.Size([1, 32, 10, 10])
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, *, g: int = 1, act: bool = True):
        super().__init__()
        for name, value in (("c1", c1), ("c2", c2), ("k", k), ("s", s), ("g", g)):
            check_int(name, value)
        check_bool("act", act)
        if c1 % g or c2 % g:
            raise ValueError(f"groups g={g} must divide both c1={c1} and c2={c2}")
        self.c1 = c1
        self.conv = nn.Conv2d(c1, c2, k, s, padding=k // 2, groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.act: nn.Module = nn.SiLU() if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        _check_map(x, self.c1, "Conv")
        check_meets("x", x, self.conv.weight, "Conv")
        return self.act(self.bn(self.conv(x)))


class Attention(nn.Module):
    """Multi-head self-attention over the N = H·W pixels, plus a depthwise 3×3 positional term.

    ``out = proj(attend(q, k, v) + pe(v))``, where q, k, v come from one 1×1 convolution and
    ``pe`` is a 3×3 depthwise convolution of the values seen as a map again: the attention gives
    every pixel a global view, ``pe`` restores a sense of position (there is no positional
    embedding). ``scale = kd ** -0.5``.

    Args:
        dim: channels C in and out.
        num_heads: heads nh; must divide ``dim`` (``hd = dim // nh``).
        attn_ratio: ``kd = int(hd · attn_ratio)``, the query/key width per head.
        backend: the :func:`dikkat.attention` backend. The default ``"reference"`` is the plain
            formula in Ultralytics' order of operations and reproduces their output bit for bit
            in fp32; ``"sdpa"``, ``"tiled"`` (O(N) memory) and ``"auto"`` agree to fp32 rounding
            (they sum in another order: ~1e-7 relative per block, up to ~1e-5–1e-4 after deep stacks
            with large activations).

    >>> Attention(64, num_heads=2)(torch.randn(1, 64, 5, 5)).shape
    torch.Size([1, 64, 5, 5])
    """

    def __init__(
        self, dim: int, num_heads: int = 8, attn_ratio: float = 0.5, *, backend: str = "reference"
    ):
        super().__init__()
        check_int("dim", dim)
        check_int("num_heads", num_heads)
        _ratio("attn_ratio", attn_ratio)
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide dim={dim}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        if self.key_dim < 1:
            raise ValueError(
                f"attn_ratio={attn_ratio} gives key_dim = int({self.head_dim} · {attn_ratio}) = "
                f"{self.key_dim}; it must be at least 1"
            )
        self.scale = self.key_dim**-0.5
        self.backend = backend  # checked by the setter below
        self.qkv = Conv(dim, dim + 2 * self.key_dim * num_heads, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, g=dim, act=False)

    @property
    def backend(self) -> str:
        """The :func:`dikkat.attention` backend; may be changed on a built block."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = check_backend_name("backend", name, exact_only=True)  # softmax attention

    def forward(self, x: Tensor) -> Tensor:
        _check_map(x, self.dim, "Attention")
        B, C, H, W = x.shape
        N = H * W
        kd, hd = self.key_dim, self.head_dim
        # The qkv channels are grouped per head: [q (kd), k (kd), v (hd)] for head 0, then head 1…
        qkv = self.qkv(x).view(B, self.num_heads, 2 * kd + hd, N)
        q, k, v = qkv.split([kd, kd, hd], dim=2)  # (B, nh, kd, N), (B, nh, kd, N), (B, nh, hd, N)
        out = attention(
            q.transpose(-2, -1),  # (B, nh, N, kd)
            k.transpose(-2, -1),  # (B, nh, N, kd)
            v.transpose(-2, -1),  # (B, nh, N, hd)
            scale=self.scale,
            backend=self.backend,
        )  # (B, nh, N, hd)
        out = out.transpose(-2, -1).reshape(B, C, H, W)  # channel = head · hd + i, as v's
        return self.proj(out + self.pe(v.reshape(B, C, H, W)))


class PSABlock(nn.Module):
    """Attention then a 1×1 feed-forward pair (C → 2C → C), each with a residual.

    ``x = x + attn(x); x = x + ffn(x)`` (no residuals when ``shortcut=False``).

    >>> PSABlock(64, num_heads=1)(torch.randn(1, 64, 4, 4)).shape
    torch.Size([1, 64, 4, 4])
    """

    def __init__(
        self,
        c: int,
        attn_ratio: float = 0.5,
        num_heads: int = 4,
        shortcut: bool = True,
        *,
        backend: str = "reference",
    ):
        super().__init__()
        check_bool("shortcut", shortcut)
        self.attn = Attention(c, num_heads=num_heads, attn_ratio=attn_ratio, backend=backend)
        self.ffn = nn.Sequential(Conv(c, 2 * c, 1), Conv(2 * c, c, 1, act=False))
        self.add = shortcut

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C2PSA(nn.Module):
    """CSP split around a stack of PSA blocks: half the channels go through attention.

    ``a, b = split(cv1(x))`` (c channels each, c = int(c1 · e)); ``b = m(b)``;
    ``out = cv2(cat(a, b))``. Each PSABlock has ``max(c // 64, 1)`` heads. Input and output
    channels are equal (``c1 == c2``).

    >>> C2PSA(128, 128)(torch.randn(1, 128, 20, 20)).shape
    torch.Size([1, 128, 20, 20])
    """

    def __init__(self, c1: int, c2: int, n: int = 1, e: float = 0.5, *, backend: str = "reference"):
        super().__init__()
        check_int("c1", c1)
        check_int("c2", c2)
        check_int("n", n)
        _ratio("e", e)
        if c1 != c2:
            raise ValueError(f"C2PSA keeps the width: c1={c1} and c2={c2} must be equal")
        self.c1 = c1
        self.c = int(c1 * e)
        if self.c < 1:
            raise ValueError(f"e={e} leaves c = int({c1} · {e}) = {self.c} hidden channels")
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        heads = max(self.c // 64, 1)
        self.m = nn.Sequential(
            *(PSABlock(self.c, 0.5, num_heads=heads, backend=backend) for _ in range(n))
        )

    def forward(self, x: Tensor) -> Tensor:
        _check_map(x, self.c1, "C2PSA")
        a, b = self.cv1(x).split((self.c, self.c), dim=1)  # (B, c, H, W) each
        return self.cv2(torch.cat((a, self.m(b)), dim=1))


class Bottleneck(nn.Module):
    """Two convolutions (kernels ``k``), ``c2 · e`` channels between, residual when shapes allow.

    >>> Bottleneck(32, 32)(torch.randn(1, 32, 8, 8)).shape
    torch.Size([1, 32, 8, 8])
    """

    def __init__(
        self,
        c1: int,
        c2: int,
        shortcut: bool = True,
        g: int = 1,
        k: tuple[int, int] = (3, 3),
        e: float = 0.5,
    ):
        super().__init__()
        check_bool("shortcut", shortcut)
        _ratio("e", e)
        hidden = int(c2 * e)
        if hidden < 1:
            raise ValueError(f"e={e} leaves int({c2} · {e}) = {hidden} hidden channels")
        self.cv1 = Conv(c1, hidden, k[0])
        self.cv2 = Conv(hidden, c2, k[1], g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3k2(nn.Module):
    """YOLO26's neck block: a C2f (keep every intermediate, concatenate) whose inner blocks are a
    Bottleneck followed by a PSABlock.

    ``y = [a, b] = chunk(cv1(x))`` (c = int(c2 · e) channels each); each inner block appends
    ``m_i(y[-1])``; ``out = cv2(cat(y))`` from (2 + n)·c channels. With ``attn=False`` the inner
    blocks are plain Bottlenecks (Ultralytics' ``c3k=True`` variant is not provided).

    >>> C3k2(64, 128)(torch.randn(1, 64, 10, 10)).shape
    torch.Size([1, 128, 10, 10])
    """

    def __init__(
        self,
        c1: int,
        c2: int,
        n: int = 1,
        c3k: bool = False,
        e: float = 0.5,
        attn: bool = True,
        g: int = 1,
        shortcut: bool = True,
        *,
        backend: str = "reference",
    ):
        super().__init__()
        for name, value in (("c1", c1), ("c2", c2), ("n", n), ("g", g)):
            check_int(name, value)
        for name, flag in (("c3k", c3k), ("attn", attn), ("shortcut", shortcut)):
            check_bool(name, flag)
        _ratio("e", e)
        check_backend_name("backend", backend, exact_only=True)  # attn=False builds no Attention
        if c3k and not attn:
            raise ValueError("C3k2 with c3k=True and attn=False (C3k inner blocks) is not provided")
        self.c1 = c1
        self.c = c = int(c2 * e)
        if c < 1:
            raise ValueError(f"e={e} leaves c = int({c2} · {e}) = {c} hidden channels")
        self.cv1 = Conv(c1, 2 * c, 1)
        self.cv2 = Conv((2 + n) * c, c2, 1)
        heads = max(c // 64, 1)
        self.m = nn.ModuleList(
            nn.Sequential(
                Bottleneck(c, c, shortcut, g),
                PSABlock(c, 0.5, num_heads=heads, backend=backend),
            )
            if attn
            else Bottleneck(c, c, shortcut, g)
            for _ in range(n)
        )

    def forward(self, x: Tensor) -> Tensor:
        _check_map(x, self.c1, "C3k2")
        y = list(self.cv1(x).chunk(2, dim=1))  # [(B, c, H, W)] * 2
        for block in self.m:
            y.append(block(y[-1]))
        return self.cv2(torch.cat(y, dim=1))  # (B, (2 + n)·c, H, W) → (B, c2, H, W)
