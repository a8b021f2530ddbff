"""Large weights on huge pages (dikkat.weights.pages): a tensor of the shape and dtype asked,
starting on a huge page's boundary where it is large, plain where it is small, and usable as
any tensor (its buffer kept alive by the view)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from dikkat.weights.pages import HUGE_PAGE, empty_on_huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_a_large_tensor_starts_on_a_huge_page(dtype):
    rows = 3 * HUGE_PAGE // (1024 * torch.empty((), dtype=dtype).element_size())
    t = empty_on_huge_pages((rows, 1024), dtype)
    assert t.shape == (rows, 1024) and t.dtype == dtype and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(3)
    gc.collect()  # the view holds the buffer it lies in
    assert bool((t == 3).all())


def test_a_small_tensor_is_a_plain_one():
    t = empty_on_huge_pages((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.untyped_storage().nbytes() == 4 * 8 * 4
