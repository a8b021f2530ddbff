"""Ring attention on 2 and 4 CPU processes (gloo) against the fp64 reference on the whole
sequence: output, log-sum-exp and the three gradients, for both layouts and every mask shape,
with an uneven length (tests/distributed/ring_cases.py runs the cases in each process)."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp
from ring_cases import run

TIMEOUT_S = 120  # a hung ring fails the test instead of hanging it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int) -> None:
    context = mp.spawn(run, args=(world, free_port()), nprocs=world, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):  # raises as soon as a child fails
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"ring attention on {world} ranks did not finish in {TIMEOUT_S} s")


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_the_reference(world):
    spawn(world)
