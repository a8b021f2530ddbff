"""Time and peak memory of one call, measured from inside the process.

Peak memory is Linux's high-water mark of resident memory: writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM`` to the current ``VmRSS``, so after a call
``VmHWM − VmRSS(before)`` is what the call needed on top of what was already resident. CPU
tensors live in ordinary process memory, so temporaries count too.

That only works if a call's large allocations are fresh pages. glibc serves big blocks with
``mmap`` and returns them on ``free``, but it raises its mmap threshold after the first large
free, and from then on big temporaries reuse heap the process already holds: the peak reads 0.
:func:`peak_memory` therefore first hands every free page back to the system
(``malloc_trim(0)``): whatever the call then allocates, fresh mmap or reused heap, is faulted in
anew and counted. The mmap threshold is fixed at 32 MiB, the most glibc's own adjustment
reaches on 64-bit, so timed calls reuse memory as any warmed-up process does (pinning it low
instead made every temporary a fresh mmap and slowed allocation-heavy code ~2× here). Where
glibc is unavailable (not Linux, not glibc) memory is reported as unavailable (None).
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["memory_tracking", "peak_memory", "timeit"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
_RUN = 32 * 1024 * 1024  # glibc's largest dynamic threshold: blocks below it are reused
_tracking: bool | None = None  # decided on first use
_libc: ctypes.CDLL | None = None


def timeit(
    fn: Callable[[], object], *, min_time: float = 0.3, warmup: int = 1, max_calls: int = 50
) -> float:
    """Median seconds per call over repeated calls lasting at least ``min_time`` in total
    (at least one call, at most ``max_calls``), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while not times or (time.perf_counter() - start < min_time and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _set_threshold(nbytes: int) -> bool:
    """glibc's mmap threshold (and its trim threshold, twice that, as glibc itself keeps it)."""
    assert _libc is not None
    ok = _libc.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1  # 1 = success
    return ok and _libc.mallopt(_M_TRIM_THRESHOLD, 2 * nbytes) == 1


def _start_tracking() -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        _libc = ctypes.CDLL("libc.so.6")
        Path("/proc/self/clear_refs").write_text("5")
        _status_bytes("VmHWM")
    except (OSError, AttributeError, RuntimeError):  # no glibc, or no writable /proc
        return False
    return _set_threshold(_RUN)


def memory_tracking() -> bool:
    """Whether :func:`peak_memory` can measure here (takes over glibc's mmap threshold)."""
    global _tracking
    if _tracking is None:
        _tracking = _start_tracking()
    return _tracking


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def peak_memory(fn: Callable[[], object]) -> int | None:
    """Bytes by which one call of ``fn`` raises this process's peak resident memory, its result
    included (it is freed only after the peak is read); None where this cannot be measured."""
    if not memory_tracking():
        return None
    # young garbage only: a full collection walks every object torch created (≈ 0.1 s a call),
    # and older garbage left over is resident before and after, so it changes no difference
    gc.collect(1)
    assert _libc is not None
    _libc.malloc_trim(0)  # free memory leaves the resident set: reusing it counts again
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    out = fn()
    peak = _status_bytes("VmHWM")
    del out
    return max(0, peak - before)
