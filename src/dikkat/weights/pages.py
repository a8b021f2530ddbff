"""Memory for large weights on the system's huge pages.

Decoding reads every weight once a token, so a step is as fast as memory streams them — and
streaming gigabytes through 4 KiB pages costs a TLB miss, and a page walk, every 4 KiB. Linux
backs memory with 2 MiB pages where a program asks for them (``madvise(MADV_HUGEPAGE)``;
https://docs.kernel.org/admin-guide/mm/transhuge.html), which its default ``madvise`` mode of
transparent huge pages requires: :func:`empty_on_huge_pages` allocates a tensor so, starting on
a 2 MiB boundary, before any of its pages is touched. Elsewhere (another system, huge pages
turned off) it is a plain ``torch.empty``. BENCHMARKS.md ("16-bit files") measures what it gives
a decode step.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["HUGE_PAGE", "empty_on_huge_pages"]

HUGE_PAGE = 2 << 20  # bytes of an x86-64 (and arm64 4 KiB-granule) huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h>


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (address, length, advice) → 0 on success; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype``, contiguous; where it takes at
    least two huge pages, a view starting at a huge page's boundary of a buffer one huge page
    longer, whose memory is advised onto huge pages (on Linux; where the advice is refused,
    the memory is ordinary). The buffer's unused ends are never touched, so they take no
    resident memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < 2 * HUGE_PAGE:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + skip, nbytes, _MADV_HUGEPAGE)  # refused: ordinary pages, as asked
    return raw[skip : skip + nbytes].view(dtype).view(tuple(shape))
