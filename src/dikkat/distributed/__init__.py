"""Attention over a sequence sharded across processes (context parallelism), on
``torch.distributed``: :func:`ring_attention`, and :func:`shard_sequence` /
:func:`gather_sequence` to cut a global tensor into the shards it expects and put them back.
docs/distributed.md explains the layouts, the masks on global positions and the tests.
"""

from dikkat.distributed.layout import (
    LAYOUTS,
    chunk_bounds,
    gather_sequence,
    shard_positions,
    shard_sequence,
)
from dikkat.distributed.ring import RingStats, ring_attention

__all__ = ["LAYOUTS", "RingStats", "chunk_bounds", "gather_sequence", "ring_attention",
           "shard_positions", "shard_sequence"]  # fmt: skip
