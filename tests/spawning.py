"""Multi-process tests: start a test's ranks with ``torch.multiprocessing.spawn`` on a free
loopback port, fail the test (killing them) if they outlive a deadline — a hung collective must
not hang the suite — and, in each rank, join and leave the gloo process group."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., None], world: int, what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Run ``fn(rank, world, port)`` in ``world`` processes; a child's exception fails the test."""
    context = mp.spawn(fn, args=(world, free_port()), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises as soon as a child fails
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"{what} on {world} ranks did not finish in {timeout_s} s")


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """In a spawned rank: one torch thread, the gloo group on 127.0.0.1:``port``, left after."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()
