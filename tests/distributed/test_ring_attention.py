"""Ring attention on 2 and 4 CPU processes (gloo) against the fp64 reference on the whole
sequence: output, log-sum-exp and the three gradients, for both layouts and every mask shape,
with an uneven length, and on 2 processes shards laid out as transposed, sliced, channels-last and
expanded views (tests/distributed/ring_cases.py runs the cases in each process)."""

from __future__ import annotations

import pytest
from ring_cases import run

from spawning import spawn


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_the_reference(world):
    spawn(run, world, "ring attention")
