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
        return self.body(self.tok_emb(ids))

    def body(self, emb: Tensor) -> Tensor:
        """The layer after the token embedding: (B, T, C) → (B, T, V)."""
        B, T, _ = emb.shape
        x = emb + self.pos[:T]  # (B, T, C)
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


class CausalLM(OneLayerLM):
    """:class:`OneLayerLM` under ``causal()``: correct, the base of the subtle leaks below."""

    def __init__(self) -> None:
        super().__init__(lambda T: dikkat.masks.causal())


class SmallLeakLM(CausalLM):
    """Causal, but every output also reads the next token, ``size`` × the outputs' own scale: a
    leak far below an absolute tolerance of 1e-4 of the output scale."""

    def __init__(self, size: float = 1e-5) -> None:
        super().__init__()
        self.size = size
        self.peek = nn.Linear(self.tok_emb.embedding_dim, V)  # as large as the head's outputs

    def forward(self, ids: Tensor) -> Tensor:
        emb = self.tok_emb(ids)  # (B, T, C), once: the audit's gradients are taken here
        out = self.body(emb)  # (B, T, V)
        leak = self.peek(emb[:, 1:])  # (B, T − 1, V): token i + 1
        return torch.cat([out[:, :-1] + self.size * leak, out[:, -1:]], dim=1)


class TinyOutputLM(CausalLM):
    """Causal outputs scaled by 1e3, except one tiny output (scale 1e-6) that reads the token
    ``key`` with a tenth of its own scale: an absolute or whole-position tolerance hides it.

    ``tiny="logit"`` makes logit 0 at ``query`` the tiny one (the others there are huge);
    ``tiny="position"`` every logit at ``query``.
    """

    def __init__(self, tiny: str = "logit", query: int = 3, key: int = 5) -> None:
        super().__init__()
        self.features = slice(0, 1) if tiny == "logit" else slice(None)
        self.query, self.key = query, key
        self.peek = nn.Linear(self.tok_emb.embedding_dim, V)

    def forward(self, ids: Tensor) -> Tensor:
        emb = self.tok_emb(ids)  # (B, T, C)
        out = self.body(emb) * 1e3  # (B, T, V)
        q, f = self.query, self.features
        leak = 0.1 * self.peek(emb[:, self.key])[:, f]  # (B, V) or (B, 1)
        tiny = 1e-6 * (out[:, q, f] / 1e3 + leak)
        return torch.cat([out[:, :q], self.with_features(out[:, q], f, tiny), out[:, q + 1 :]], 1)

    @staticmethod
    def with_features(row: Tensor, f: slice, value: Tensor) -> Tensor:
        row = row.clone()
        row[:, f] = value
        return row[:, None]  # (B, 1, V)


class GatedLeakLM(CausalLM):
    """Causal, but the output at ``query`` reads the token at ``key`` (later) when, and only
    when, that token is ``value``: a gate on the id, flat for gradients and rare for random
    tokens."""

    def __init__(self, value: int = 17, query: int = 2, key: int = 6) -> None:
        super().__init__()
        self.value, self.query, self.key = value, query, key
        self.peek = nn.Linear(self.tok_emb.embedding_dim, V)

    def forward(self, ids: Tensor) -> Tensor:
        emb = self.tok_emb(ids)  # (B, T, C)
        out = self.body(emb)  # (B, T, V)
        gate = (ids[:, self.key] == self.value).to(out.dtype)[:, None]  # (B, 1)
        leak = gate * self.peek(emb[:, self.key])  # (B, V): zero unless the gate is open
        at = torch.zeros_like(out)
        at[:, self.query] = leak
        return out + at
