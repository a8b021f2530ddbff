"""Tiny models for the audits: correct ones, and ones broken on purpose.

Notation: ``B`` batch, ``T`` tokens, ``C`` width, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

import dikkat
from dikkat.core.masks import Mask
from dikkat.models import GPT, GPTConfig

V = 32  # vocabulary of every tiny model here


def gpt(**overrides: object) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, max_len=32)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


class OneLayerLM(nn.Module):
    """Embedding, learned positions, one attention layer under ``mask_of(T)``, logits: small
    enough that its dependences are the mask itself (plus each position's own token)."""

    def __init__(self, mask_of: Callable[[int], Mask | None], width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mask_of = mask_of
        self.tok_emb = nn.Embedding(V, width)
        self.pos = nn.Parameter(torch.randn(32, width))
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, V)

    def forward(self, ids: Tensor) -> Tensor:
        B, T = ids.shape
        x = self.tok_emb(ids) + self.pos[:T]  # (B, T, C)
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = dikkat.attention(q, k, v, self.mask_of(T))  # (B, 2, T, C/2)
        return self.head(x + out.transpose(1, 2).reshape(B, T, -1))  # (B, T, V)


class WrongOffsetGPT(GPT):
    """A GPT whose decode steps write their keys one cache slot too early (and take that
    position): the bug a cache offset off by one makes."""

    def forward(self, ids: Tensor, mask=None, *, offset: int = 0, cache=None, **kwargs) -> Tensor:
        if cache is not None and offset > 0:
            offset -= 1
        return super().forward(ids, mask, offset=offset, cache=cache, **kwargs)


def all_pairs(T: int, keep: Callable[[int, int], bool]) -> tuple[tuple[int, int], ...]:
    return tuple((i, j) for i in range(T) for j in range(T) if keep(i, j))
