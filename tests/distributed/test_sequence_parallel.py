"""A GPT trained with its sequence split over 2 and 4 CPU processes (gloo), every attention layer
running the ring, equals the same GPT trained on whole sequences in one process: the loss of each
step, the logits and the weights reached, in fp64, for RoPE and learned positions and both
layouts (tests/distributed/gpt_cases.py runs in each process)."""

from __future__ import annotations

import pytest
from gpt_cases import run

from spawning import spawn


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_gpt_trains_as_one_process(world):
    spawn(run, world, "sequence-parallel GPT training")
