"""Context parallelism for dikkat's own models: a model whose sequence is split over the ranks
of a process group, every self-attention layer running :func:`ring_attention`.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T`` a rank's tokens,
``N`` the whole sequence, ``D`` head dim, ``W`` ranks.

Everything in a Transformer but attention acts on each token alone, so a model runs on a shard
of the sequence unchanged once three things see the whole: attention (the ring, registered as
a :func:`dikkat.attention` backend and set on every :class:`MultiHeadAttention` by
:meth:`SequenceParallel.attend`), the positions (each rank passes its tokens' global ones,
:meth:`SequenceParallel.positions`), and the loss (each rank's sum over its tokens divided by
the count over all ranks, then the parameter gradients summed over the ranks,
:meth:`SequenceParallel.sum_gradients`). docs/distributed.md shows a training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dikkat.core.attention import register_backend
from dikkat.core.backends import AttentionRequest, Backend
from dikkat.distributed.layout import (
    check_layout,
    gather_sequence,
    rank_and_world,
    shard_positions,
    shard_sequence,
)
from dikkat.distributed.ring import ring_attention
from dikkat.layers.attention import MultiHeadAttention

__all__ = ["SequenceParallel"]


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """The sequence split over the ranks of ``group`` in ``layout``, and the attention backend
    ``backend_name`` that runs the ring over them (registered on construction; not one
    ``auto`` picks).

    >>> sp = SequenceParallel()  # doctest: +SKIP  (inside an initialised process group)
    >>> ids_local, targets_local = sp.shard(ids), sp.shard(targets)
    >>> with sp.attend(model):
    ...     logits = model(ids_local, positions=sp.positions(ids.shape[1]))
    """

    group: dist.ProcessGroup | None = None  # None: the default group
    layout: str = "zigzag"  # as dikkat.distributed.shard_sequence cuts
    backend_name: str = "ring"
    backend: Backend = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_layout(self.layout)
        rank_and_world(self.group, "SequenceParallel")  # a clear error before any model runs
        if not isinstance(self.backend_name, str) or not self.backend_name:
            raise TypeError(f"backend_name must be a non-empty str, got {self.backend_name!r}")
        backend = Backend(
            name=self.backend_name,
            run=self._run,
            supports=_supports,
            doc=f"ring attention over the {self.layout} shards of a process group's ranks",
            finite_rule=False,  # ring_attention refuses non-finite inputs on every rank
        )
        object.__setattr__(self, "backend", backend)
        register_backend(backend)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of the global ``x`` (the same on every rank) along ``dim``:
        token ids and targets (B, N) → (B, T)."""
        return shard_sequence(x, dim, self.layout, self.group)

    def gather(self, x_local: Tensor, dim: int = 1) -> Tensor:
        """The global tensor from every rank's shard along ``dim`` (not differentiable)."""
        return gather_sequence(x_local, dim, self.layout, self.group)

    def positions(self, length: int, device: torch.device | str | None = None) -> Tensor:
        """The global positions (T,) of this rank's tokens of a sequence of ``length``: what
        the model's ``positions=`` needs for learned embeddings and RoPE."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length must be a positive int, got {length!r}")
        return shard_positions(length, self.layout, self.group, device)

    @contextmanager
    def attend(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within the block, every self-attention layer of ``model`` runs on this backend (the
        ring); their backends are restored after. Cross-attention layers are refused: their
        context is not a shard of the sequence."""
        layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        if not layers:
            raise ValueError(
                f"{type(model).__name__} has no dikkat MultiHeadAttention layer to run as ring "
                "attention (for a Hugging Face model see docs/distributed.md)"
            )
        cross = [m for m in layers if m.qkv_proj is None]
        if cross:
            raise ValueError(
                f"{type(model).__name__} has {len(cross)} cross-attention layer(s): sequence "
                "parallelism here splits self-attention only"
            )
        before = [m.backend for m in layers]
        for m in layers:
            m.backend = self.backend_name
        try:
            yield model
        finally:
            for m, name in zip(layers, before, strict=True):
                m.backend = name

    def sum_gradients(self, model: nn.Module) -> None:
        """Sum every parameter's gradient over the ranks (one all-reduce of them flattened):
        each rank's backward gives the gradient of its tokens' share of the loss."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            raise ValueError("no parameter has a gradient: call backward() on the loss first")
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _run(self, r: AttentionRequest) -> tuple[Tensor, None, Tensor | None]:
        result = ring_attention(
            r.q, r.k, r.v, r.mask, group=self.group, layout=self.layout, scale=r.scale,
            return_lse=r.return_lse,
        )  # fmt: skip
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out, None, lse


def _supports(r: AttentionRequest) -> str | None:
    """Why the ring cannot serve ``r`` (each rank sees only its shard), or None."""
    if r.bias is not None:
        return "it takes no additive bias (ALiBi, T5's position bias)"
    if r.softcap is not None:
        return "it does not soft-cap the scores"
    if r.q_offset != 0:
        return "a KV cache's q_offset: it attends over the shards, not a cache"
    if r.dropout > 0:
        return "it has no attention dropout (set the model's dropout to 0)"
    if r.return_weights:
        return "it returns no weights (dikkat.capture works on one process)"
    return None
