"""Attention over a sequence sharded across processes (context parallelism), on
``torch.distributed``: :func:`ring_attention`, :func:`shard_sequence` / :func:`gather_sequence`
to cut a global tensor into the shards it expects and put them back, :func:`shard_positions` for
the global positions of a rank's shard, and :class:`SequenceParallel` to run a dikkat model on
shards. docs/distributed.md explains the layouts, the masks on global positions and the tests.
"""

from dikkat.distributed.layout import (
    LAYOUTS,
    chunk_bounds,
    gather_sequence,
    shard_positions,
    shard_sequence,
)
from dikkat.distributed.ring import RingStats, ring_attention
from dikkat.distributed.sequence import SequenceParallel

__all__ = [
    "LAYOUTS",
    "RingStats",
    "SequenceParallel",
    "chunk_bounds",
    "gather_sequence",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
]
