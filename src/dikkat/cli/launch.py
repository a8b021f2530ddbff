"""``dikkat train --nproc N``: the same command in N processes on this machine, through PyTorch's
elastic launcher (``python -m torch.distributed.run``, what ``torchrun`` runs), on loopback.

Each process is a ``dikkat train`` of the same arguments less ``--nproc``; it finds itself under
the launcher (``WORLD_SIZE`` is set) and trains as one rank (:mod:`dikkat.training.parallel`).
Several machines are launched with ``torchrun`` itself (docs/distributed-training.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from dikkat.cli.args import positive_int

LOOPBACK = "127.0.0.1"


def add_parallel(parser: argparse.ArgumentParser) -> None:
    """The ``--nproc`` and ``--fsdp`` flags."""
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        help="train data-parallel in N processes on this machine (torch.distributed; --batch-size "
        "is the batch of a step, split between them)",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the weights, gradients and optimizer state between the processes (FSDP2) "
        "instead of a whole copy in each (DDP); with one process nothing changes",
    )


def parallel_of(args: argparse.Namespace) -> str:
    """The Trainer's ``parallel`` for parsed ``--fsdp``."""
    return "fsdp" if args.fsdp else "ddp"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def under_launcher() -> bool:
    """Whether this process is one rank of a launched group (torchrun sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less its ``--nproc N`` (or ``--nproc=N``, or an abbreviation argparse took for
    it): the launcher parses the words after the module too, and would take them for its own."""
    out, skip = [], False
    for word in argv:
        flag, eq, _ = word.partition("=")
        if skip:
            skip = False
        elif len(flag) >= 4 and "--nproc".startswith(flag):
            skip = not eq
        else:
            out.append(word)
    return out


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m dikkat ARGV`` as ``nproc`` ranks on loopback; the launcher's exit status
    (not 0 when any rank failed: the launcher then stops the others)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        LOOPBACK,
        "--master_port",
        str(free_port()),
        "-m",
        "dikkat",
        *without_nproc(argv),
    ]
    return subprocess.call(command)
