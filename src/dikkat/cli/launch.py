"""``dikkat train --nproc N``: the same command in N processes on this machine, through PyTorch's
elastic launcher (what ``torchrun`` runs), on loopback.

Each process is a ``dikkat train`` of the same arguments less ``--nproc``; it finds itself under
the launcher (``WORLD_SIZE`` is set) and trains as one rank (:mod:`dikkat.training.parallel`).
Several machines are launched with ``torchrun`` itself (docs/distributed-training.md).

The ``dikkat train --nproc`` process runs the launcher's agent itself, so it is the ranks'
parent (not the parent of a ``torchrun`` process that is theirs), and a signal to it reaches
every rank: SIGINT, SIGTERM, SIGHUP and SIGQUIT are the agent's to handle — it sends the signal
on to each rank and waits for them (up to its shutdown timeout, 30 s) — and a rank ends after
the step in flight, with one save. If it dies without passing anything on (SIGKILL, a crash),
the kernel ends the ranks too (:func:`die_with`): nothing goes on training and committing
checkpoints behind it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

from dikkat.cli.args import positive_int
from dikkat.runs import HOLDER_ENV

LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # prctl(2), <linux/prctl.h>
# the signals the agent sends on to the ranks (torchrun's --signals_to_handle, by default)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


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


def die_with(parent: int) -> None:
    """End this process (SIGKILL) as soon as process ``parent``, its parent now, ends.

    On Linux the kernel does it (``prctl(PR_SET_PDEATHSIG)``, which fires when the thread that
    started this process ends: the launcher's main thread); elsewhere a daemon thread checks
    the parent twice a second. A parent that is already gone ends this process now."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    if os.getppid() != parent:  # it ended before the line above
        os.kill(os.getpid(), signal.SIGKILL)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dikkat-die-with-parent", daemon=True).start()


def die_with_launcher() -> None:
    """In a rank started by :func:`launch`: end with the launcher (:func:`die_with`)."""
    launcher = os.environ.get(HOLDER_ENV)
    if under_launcher() and launcher is not None and launcher.isdigit():
        die_with(int(launcher))


@contextlib.contextmanager
def _launcher_state() -> Iterator[None]:
    """The agent changes its process — signal handlers, environment variables, log output, the
    thread's name; put the first two back afterwards and keep its warnings (each signal sent on)
    off the terminal, where the ranks' own one-line messages say what happened."""
    handlers = {sig: signal.getsignal(sig) for sig in FORWARDED}
    environ = dict(os.environ)
    names = [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.el")]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m dikkat ARGV`` as ``nproc`` ranks on loopback, this process their agent;
    its exit status: 0, the first failed rank's, or 128 + the signal that stopped them.

    The caller holds the run's lock (:func:`dikkat.runs.hold`); the ranks learn from
    :data:`dikkat.runs.HOLDER_ENV` that it holds it for them, and end with this process."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(
        [
            "--nnodes", "1",
            "--nproc_per_node", str(nproc),
            "--master_addr", LOOPBACK,
            "--master_port", str(free_port()),
            "-m", "dikkat",
            *without_nproc(argv),
        ]
    )  # fmt: skip
    with _launcher_state():
        os.environ[HOLDER_ENV] = str(os.getpid())
        try:
            run(args)
        except SignalException as e:
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            failure = e.failures[min(e.failures)]  # each failed rank printed its own error
            code = failure.exitcode
            return 128 - code if code < 0 else code or 1
    return 0
