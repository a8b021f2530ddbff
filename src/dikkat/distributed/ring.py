"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` local query/key
length (a rank's shard), ``D``/``Dv`` head dims, ``W`` ranks.

Each rank keeps its queries; the key/value blocks travel round the ring (rank r sends to r + 1,
receives from r − 1), the transfer of the next block overlapping the compute of the current one,
and each rank merges its partial results by their log-sum-exp (Liu et al. 2023, "Ring Attention
with Blockwise Transformers", arXiv:2310.01889). The backward pass sends the blocks round
again with their dK and dV, which each rank adds to on the way, back to their owner; dQ stays
local. Masks see global positions (:mod:`dikkat.distributed.blocks`); a block no query of a rank
can see is not computed, and the ring stops after the last step any rank needs (a sliding window
over contiguous shards needs one). docs/distributed.md has the whole picture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from dikkat.core.checks import broadcast_kv, check_flag, check_qkv, check_scale
from dikkat.core.masks import Mask, as_mask
from dikkat.distributed.blocks import block_backward, block_forward, pairs
from dikkat.distributed.layout import check_layout, rank_and_world, rank_chunks, shard_length

__all__ = ["RingStats", "ring_attention"]


@dataclass
class RingStats:
    """What one :func:`ring_attention` call did on this rank, filled in by its forward pass."""

    ring_steps: int = 0  # blocks received from the previous rank (0 … W − 1)
    blocks_computed: int = 0  # key/value blocks (one per rank) this rank's queries could see
    blocks_skipped: int = 0  # blocks the mask hides from all of them: never computed
    pairs_computed: int = 0  # (query chunk, key chunk) attention calls
    computed_by_rank: list[int] = field(default_factory=list)  # owner ranks of computed blocks


@dataclass(frozen=True, eq=False)
class Ring:
    """Who holds what: the layout of the queries and keys over the ranks, and the steps to run."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    layout: str
    T_total: int
    S_total: int
    mask: Mask | None
    scale: float
    steps: int  # ring steps any rank needs

    def q_chunks(self, rank: int | None = None) -> list[tuple[int, int]]:
        return rank_chunks(self.T_total, self.rank if rank is None else rank, self.world,
                           self.layout)  # fmt: skip

    def k_chunks(self, rank: int) -> list[tuple[int, int]]:
        return rank_chunks(self.S_total, rank, self.world, self.layout)

    def s_local(self, rank: int) -> int:
        return shard_length(self.S_total, rank, self.world, self.layout)

    def peer(self, offset: int) -> int:
        """The global rank of the rank ``offset`` places further round the ring."""
        r = (self.rank + offset) % self.world
        return r if self.group is None else dist.get_global_rank(self.group, r)


def _steps_needed(world: int, layout: str, T: int, S: int, mask: Mask | None) -> int:
    """The last ring step at which some rank's queries see some of the block it receives."""
    last = 0
    for r in range(world):
        for step in range(1, world):
            owner = (r - step) % world
            q_ch, k_ch = rank_chunks(T, r, world, layout), rank_chunks(S, owner, world, layout)
            if pairs(mask, q_ch, k_ch, S):
                last = max(last, step)
    return last


def _shapes_everywhere(q: Tensor, k: Tensor, v: Tensor, ring_group, world: int) -> list[list[int]]:
    B, H, T, D = q.shape
    finite = int(all(bool(torch.isfinite(t).all()) for t in (q, k, v)))
    mine = torch.tensor([B, H, k.shape[1], D, v.shape[3], T, k.shape[2], finite], device=q.device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=ring_group)
    return [t.tolist() for t in every]


def _ring(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | Tensor | None, group: dist.ProcessGroup | None,
    layout: str, scale: float | None,
) -> Ring:  # fmt: skip
    layout = check_layout(layout)
    rank, world = rank_and_world(group, "ring_attention")
    shape = check_qkv(q, k, v)
    every = _shapes_everywhere(q, k, v, group, world)
    heads = {tuple(s[:5]) for s in every}
    if len(heads) > 1:
        raise ValueError(
            f"the ranks' shards disagree on (B, H, G, D, Dv): {[s[:5] for s in every]} "
            f"(this rank: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
        )
    bad = [r for r, s in enumerate(every) if not s[7]]
    if bad:  # every rank raises: none is left waiting for the others
        raise ValueError(
            f"ring_attention got NaN or ±inf in q, k or v on rank(s) {bad}: the NaN rule of "
            "dikkat.attention (docs/attention.md) is not carried across ranks"
        )
    T_total, S_total = sum(s[5] for s in every), sum(s[6] for s in every)
    for name, col, n in (("q", 5, T_total), ("k", 6, S_total)):
        got = [s[col] for s in every]
        want = [shard_length(n, r, world, layout) for r in range(world)]
        if got != want:
            raise ValueError(
                f"the ranks' {name} shards hold {got} positions, but the {layout} layout of "
                f"{n} positions over {world} ranks gives {want} (cut them with shard_sequence)"
            )
    m = as_mask(mask)
    if m is not None:
        m.validate(shape.B, shape.H, T_total, S_total, 0)
        m = None if m.is_full else m
    steps = _steps_needed(world, layout, T_total, S_total, m)
    scale_ = check_scale(scale, shape.D)
    return Ring(group, rank, world, layout, T_total, S_total, m, scale_, steps)


GRAD_TAG = 1  # the backward's dK/dV messages, in flight beside the keys' (tag 0)


def _exchange(ring: Ring, send: list[Tensor], recv: list[Tensor], tag: int = 0) -> list[dist.Work]:
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
    ops = [dist.P2POp(dist.isend, t, ring.peer(1), ring.group, tag) for t in send]
    ops += [dist.P2POp(dist.irecv, t, ring.peer(-1), ring.group, tag) for t in recv]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _kv_buffer(ring: Ring, kv: Tensor, owner: int) -> Tensor:
    shape = list(kv.shape)
    shape[2] = ring.s_local(owner)
    return kv.new_empty(shape)


def _pass_on(
    ring: Ring, kv: Tensor, step: int, owner: int
) -> tuple[list[dist.Work], Tensor | None]:
    """Before the last step: start sending the held block (of rank ``owner``) on and receiving
    the next one, of rank ``owner − 1``; returns the transfers and the buffer it arrives in."""
    if step >= ring.steps:
        return [], None
    nxt = _kv_buffer(ring, kv, (owner - 1) % ring.world)
    return _exchange(ring, [kv], [nxt]), nxt


def ring_forward(
    ring: Ring, q: Tensor, k: Tensor, v: Tensor, stats: RingStats | None
) -> tuple[Tensor, Tensor]:
    B, H, T, _ = q.shape
    D, Dv = k.shape[3], v.shape[3]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(B, H, T, Dv, dtype=acc)
    lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device)
    kv = torch.cat([k, v], dim=-1).contiguous()  # (B, G, S, D + Dv): one message per step
    computed: list[int] = []
    n_pairs = 0
    for step in range(ring.steps + 1):
        owner = (ring.rank - step) % ring.world
        works, nxt = _pass_on(ring, kv, step, owner)
        n = block_forward(q, kv[..., :D], kv[..., D:], ring.mask, ring.scale, ring.q_chunks(),
                          ring.k_chunks(owner), ring.S_total, out, lse)  # fmt: skip
        if n:
            computed.append(owner)
            n_pairs += n
        _wait(works)
        kv = nxt if nxt is not None else kv
    if stats is not None:
        stats.ring_steps = ring.steps
        stats.blocks_computed = len(computed)
        stats.blocks_skipped = ring.world - len(computed)
        stats.pairs_computed = n_pairs
        stats.computed_by_rank = sorted(computed)
    return out.to(q.dtype), lse


def ring_backward(
    ring: Ring, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards. At each step the rank computes its share of the
    held block's dK/dV while two transfers run: the next block's keys, and the gradient the
    earlier ranks added to the held block, sent at the end of the step before. It then adds
    its share to that gradient and sends the sum on, to travel during the next step's compute.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v, out, dout = (t.to(acc) for t in (q, k, v, out, dout))
    D = k.shape[3]
    dq = torch.zeros_like(q)
    kv = torch.cat([k, v], dim=-1).contiguous()
    incoming: Tensor | None = None  # where the held block's gradient so far arrives
    in_flight: list[dist.Work] = []  # that gradient's exchange, started at the step before
    for step in range(ring.steps + 1):
        owner = (ring.rank - step) % ring.world
        works, nxt = _pass_on(ring, kv, step, owner)
        dkv = torch.zeros_like(kv)  # this rank's share of the held block's gradient
        block_backward(q, kv[..., :D], kv[..., D:], out, lse, dout, ring.mask, ring.scale,
                       ring.q_chunks(), ring.k_chunks(owner), ring.S_total, dq, dkv[..., :D],
                       dkv[..., D:])  # fmt: skip
        _wait(in_flight)
        if incoming is not None:
            dkv += incoming
        _wait(works)
        if nxt is not None:  # dkv travels on while the next block computes
            kv, incoming = nxt, torch.empty_like(nxt)
            in_flight = _exchange(ring, [dkv], [incoming], tag=GRAD_TAG)
    if ring.steps:  # the block held now, with its whole gradient, goes home
        mine = torch.empty(*k.shape[:3], kv.shape[3], dtype=acc, device=q.device)
        ops = [
            dist.P2POp(dist.isend, dkv, ring.peer(-ring.steps), ring.group),
            dist.P2POp(dist.irecv, mine, ring.peer(ring.steps), ring.group),
        ]
        _wait(dist.batch_isend_irecv(ops))
        dkv = mine
    return dq, dkv[..., :D], dkv[..., D:]


class RingAttention(torch.autograd.Function):
    """``(out, lse)`` of the ring; differentiable in q, k and v (the lse is not)."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring, stats: RingStats | None
    ) -> tuple[Tensor, Tensor]:
        out, lse = ring_forward(ring, q, k, v, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.ring, q, k, v, out, lse, dout.contiguous())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    stats: RingStats | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``: every rank calls
    it with its shard, and gets its shard of what :func:`dikkat.attention` would give on the
    whole sequence.

    Args:
        q: this rank's queries (B, H, T, D), cut by :func:`shard_sequence` along dim 2.
        k, v: this rank's keys (B, G, S, D) and values (B, G, S, Dv), cut the same way (G
            divides H; the global S may differ from the global T).
        mask: a :mod:`dikkat.masks` mask or a bool tensor broadcastable to the *global*
            (B, H, T, S) grid, on global positions (the same on every rank); True = may
            attend. A row with no allowed key gives 0 and lse −inf.
        group: the process group (None: the default one).
        layout: ``"zigzag"`` or ``"contiguous"``, as the shards were cut.
        scale: multiplies the scores; default 1/√D.
        return_lse: also return the log-sum-exp of each row (B, H, T), fp32 (fp64 for fp64).
        stats: a :class:`RingStats` to fill with what this rank computed.

    Returns:
        ``out`` (B, H, T, Dv) of this rank's queries, or ``(out, lse)`` with ``return_lse``.
        The backward pass is collective too: every rank must backpropagate through its output.
    """
    check_flag("return_lse", return_lse)
    ring = _ring(q, k, v, mask, group, layout, scale)
    k, v = broadcast_kv(k, q.shape[0]), broadcast_kv(v, q.shape[0])
    out, lse = RingAttention.apply(q, k, v, ring, stats)
    return (out, lse) if return_lse else out
