"""ViT: an image as a sequence of patches, read by a stack of pre-norm Transformer blocks.

Notation: ``B`` batch, ``Ch`` image channels, ``P`` patch side, ``N`` patches, ``T`` tokens (N,
plus one class token with ``pool="cls"``), ``C`` model width, ``H`` heads, ``L`` layers.

images (B, Ch, side, side) → N patches P pixels apart, each a k×k window, k = P + 2·overlap (the
P×P cell and ``patch_overlap`` pixels around it, zeros beyond the image), (B, N, Ch·k·k) → one
linear map to C → [class token] + patches, plus a learned vector per position → L blocks, every
token attending to every token (no mask) → final LayerNorm → the class token's state (or the
mean of all tokens) → a linear head to class logits (B, K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.layers.block import Block, BlockConfig
from dikkat.layers.inputs import check_images, check_meets
from dikkat.layers.linear import Linear
from dikkat.layers.mlp import Activation
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import LearnedPositionalEmbedding
from dikkat.models.init import init_normal_
from dikkat.models.io import SaveLoad
from dikkat.presets import pick_preset
from dikkat.validate import check_choice, check_int, check_sizes


@dataclass(frozen=True)
class ViTConfig:
    """Sizes and choices of a Vision Transformer for square images."""

    image_size: int = 8  # side of the square input image, in pixels
    channels: int = 1  # image channels Ch (1 = grey)
    patch_size: int = 2  # side P of a square patch (the stride between patches); divides image_size
    patch_overlap: int = 0  # pixels each patch also reads beyond its P×P cell on every side
    n_classes: int = 10  # K: the classifier's outputs
    d_model: int = 128  # width C
    n_layers: int = 4  # number of blocks L
    n_heads: int = 4  # heads H; head dim D = C / H
    d_ff: int | None = None  # MLP hidden width; None = 4·d_model
    pool: Literal["cls", "mean"] = "cls"  # read the class token, or average every token
    dropout: float = 0.0  # on embeddings, residual branches and attention weights
    norm_eps: float = 1e-6  # LayerNorm epsilon (the ViT paper's)
    activation: Activation = "gelu"  # exact GELU, as in the ViT paper

    def __post_init__(self) -> None:
        check_choice("pool", self.pool, ("cls", "mean"))
        check_sizes(self, "image_size", "channels", "patch_size", "n_classes", "n_layers")
        check_int("patch_overlap", self.patch_overlap, at_least=0)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}"
            )
        self.block()  # validates widths, heads, norm_eps, activation and dropout

    @property
    def grid(self) -> int:
        """Patches along one side."""
        return self.image_size // self.patch_size

    @property
    def patch_window(self) -> int:
        """k: the side of the square window each patch reads, P + 2·overlap."""
        return self.patch_size + 2 * self.patch_overlap

    @property
    def n_patches(self) -> int:
        return self.grid**2

    @property
    def n_tokens(self) -> int:
        """T: the patches, and the class token when there is one."""
        return self.n_patches + (self.pool == "cls")

    def block(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            norm="pre",
            norm_eps=self.norm_eps,
            activation=self.activation,
            dropout=self.dropout,
        )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ViTConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(VIT_PRESETS, name, "ViT", overrides)


VIT_PRESETS: dict[str, ViTConfig] = {
    # scikit-learn's 8×8 handwritten digits: 16 patches 2 pixels apart, each reading the 4×4
    # square around its 2×2 cell (16 tokens + class), width 128, 4 layers.
    "digits": ViTConfig(patch_overlap=1),
    # For tests: 4×4 patches (4 tokens + class), one narrow block; learns the digits in seconds.
    "tiny": ViTConfig(patch_size=4, d_model=64, n_layers=1, n_heads=2, d_ff=128),
    # ViT-B/16 of "An Image is Worth 16x16 Words" (ImageNet, 224×224, 1000 classes).
    "vit-base-16": ViTConfig(
        image_size=224,
        channels=3,
        patch_size=16,
        n_classes=1000,
        d_model=768,
        n_layers=12,
        n_heads=12,
    ),
}


def patchify(images: Tensor, patch_size: int, overlap: int = 0) -> Tensor:
    """(B, Ch, side, side) → (B, N, Ch·k·k), k = P + 2·overlap: patches in row-major order, each
    flattened channel-first (the layout a stride-P, k×k convolution with padding ``overlap``
    would read); pixels beyond the image are 0. With overlap 0 the patches are disjoint."""
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a tensor (B, Ch, side, side), got {type(images).__name__}")
    for name, value, least in (("patch_size", patch_size, 1), ("overlap", overlap, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int ≥ {least}, got {value!r}")
    shape = tuple(images.shape)
    if images.dim() != 4 or shape[2] != shape[3] or shape[2] % patch_size:
        raise ValueError(
            f"images must be (B, Ch, side, side) with side divisible by patch_size={patch_size}, "
            f"got {shape}"
        )
    k = patch_size + 2 * overlap  # unfold copies each pixel into every window that holds it
    return F.unfold(images, k, padding=overlap, stride=patch_size).transpose(1, 2)


@dataclass
class AttentionMaps:
    """Where the pooled query looks, in every layer and head.

    ``weights`` (L, B, H, T): with ``pool="cls"`` the class token's attention row; with
    ``pool="mean"`` the mean of all tokens' rows (what the average then mixes). Each row sums
    to 1 over the T keys (the class token, then the patches in row-major order).
    """

    weights: Tensor
    grid: int  # patches along a side
    has_cls: bool  # key 0 is the class token

    def patches(self) -> Tensor:
        """The weights on the patches only, as images (L, B, H, grid, grid)."""
        w = self.weights[..., 1:] if self.has_cls else self.weights
        return w.reshape(*w.shape[:-1], self.grid, self.grid)


class ViT(SaveLoad, nn.Module):
    """Vision Transformer classifier.

    >>> model = ViT(ViTConfig.preset("digits"))
    >>> model(torch.rand(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    """

    config_class = ViTConfig

    def __init__(self, config: ViTConfig, *, backend: str = "auto") -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed = Linear(c.channels * c.patch_window**2, c.d_model)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model)) if c.pool == "cls" else None
        self.pos_emb = LearnedPositionalEmbedding(c.n_tokens, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c.block(), backend=backend) for _ in range(c.n_layers))
        self.norm_f = LayerNorm(c.d_model, eps=c.norm_eps)
        self.head = Linear(c.d_model, c.n_classes)
        self.apply(init_normal_)
        # as in GPT-2: the projections writing into the residual stream start smaller with depth
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layers))
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)
        # The patch embedding reads only Ch·k·k pixels (16 for the digits): its init scales with
        # that fan-in (PyTorch's Linear default, std 1/√(3·fan_in)), so the content starts above
        # the 0.02-sized positions; at ViT-B/16's fan-in of 768 that is 0.021, as before. On the
        # digits, 0.02 cost ≈ 0.85 points of held-out accuracy, paired by seed (BENCHMARKS.md).
        self.patch_embed.reset_parameters()

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, images: Tensor) -> Tensor:
        """images (B, Ch, side, side) → the tokens entering the first block (B, T, C)."""
        c = self.config
        check_images(images, c.channels, c.image_size)
        check_meets("images", images, self.patch_embed.weight, "ViT")
        x = self.patch_embed(patchify(images, c.patch_size, c.patch_overlap))  # (B, N, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return self.drop(self.pos_emb(x))  # (B, T, C)

    def forward(self, images: Tensor, *, return_hidden: bool = False) -> Tensor:
        """images (B, Ch, side, side) → logits (B, K) (or the pooled state (B, C))."""
        x = self.embed(images)
        for block in self.blocks:
            x = block(x)  # no mask: every token sees every token
        x = self.norm_f(x)
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)  # (B, C)
        return pooled if return_hidden else self.head(pooled)

    @torch.no_grad()
    def attention_maps(self, images: Tensor) -> AttentionMaps:
        """The pooled query's attention in every layer and head (see :class:`AttentionMaps`).

        Computed through the reference backend (the plain softmax, the oracle every fast path is
        tested against), whichever backend the model otherwise runs with: fused and tiled
        backends never hold the weights.
        """
        was, backends = self.training, [b.attn.backend for b in self.blocks]
        self.eval()  # no dropout on the weights we show
        try:
            x = self.embed(images)
            rows = []
            for block in self.blocks:
                block.attn.backend = "reference"
                x, w = block(x, return_weights=True)
                full = w.self_attn  # (B, H, T, T)
                rows.append(full[:, :, 0] if self.cls_token is not None else full.mean(dim=2))
        finally:
            self.train(was)
            for block, backend in zip(self.blocks, backends, strict=True):
                block.attn.backend = backend
        return AttentionMaps(torch.stack(rows), self.config.grid, self.cls_token is not None)
