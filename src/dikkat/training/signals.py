"""Ctrl-C and SIGTERM while training: finish the step in flight, then stop (and save)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped training after the step in flight; the run was saved."""

    def __init__(self, signum: int, step: int, out_dir: Path | None) -> None:
        self.signum, self.step, self.out_dir = signum, step, out_dir
        name = signal.Signals(signum).name
        where = f"; saved in {out_dir} (--resume continues)" if out_dir is not None else ""
        super().__init__(f"{name}: stopped at step {step}{where}")


@contextlib.contextmanager
def finish_step_on_signals(flag: Callable[[int], None]) -> Iterator[None]:
    """While inside, Ctrl-C (SIGINT) and SIGTERM only call ``flag(signum)``; the training loop
    checks what it set and stops after the step in flight, so a checkpoint is never taken
    between an optimizer update and its step count. (Signal handlers can only be set from the
    main thread; elsewhere signals act as usual.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        flag(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
