"""Sliding windows that look ahead: ``sliding_window(window, ahead=r)`` lets the query at position
i see the keys j with i − window < j ≤ i + r — flash-attention's ``window_size=(left, right)``
with left = window − 1, right = r. Checked against that inequality written out, on every backend
in fp64 (forward and gradients), and the tiled backend must skip what the band hides
(docs/attention.md, "Causal masks when T ≠ S" for the positions).
"""

import importlib.util

import pytest
import torch

import dikkat
from dikkat import masks
from dikkat.core import tiled

HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
BACKENDS = ("reference", "tiled", "sdpa", "auto", *(("flex",) if HAS_FLEX else ()))


def flash_window(T: int, S: int, q_offset: int, left: int, right: int) -> torch.Tensor:
    """(T, S) bool: flash-attention's window_size=(left, right) on absolute positions, a loop."""
    allowed = torch.zeros(T, S, dtype=torch.bool)
    for i in range(T):
        for j in range(S):
            allowed[i, j] = q_offset + i - left <= j <= q_offset + i + right
    return allowed


def qkv(B: int, H: int, G: int, T: int, S: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T, 16), (B, G, S, 16), (B, G, S, 16))
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)


# (T, S, q_offset, left, right): square, a decoding chunk, T > S bottom-right, a window wider
# than the keys, a look-ahead past the last key
CASES = [
    (40, 40, 0, 5, 3),
    (8, 30, 22, 4, 2),
    (12, 5, -7, 2, 4),
    (10, 10, 0, 20, 1),
    (16, 16, 0, 0, 20),
    (130, 140, 10, 30, 50),
]


@pytest.mark.parametrize("left, right", [(0, 0), (2, 1), (0, 3), (6, 6)])
@pytest.mark.parametrize("q_offset", [0, 3, -2])
def test_the_mask_is_flash_attentions_window(left, right, q_offset):
    T, S = 6, 9
    got = masks.sliding_window(left + 1, ahead=right).materialize(1, 1, T, S, q_offset)[0, 0]
    assert torch.equal(got, flash_window(T, S, q_offset, left, right))


def test_ahead_zero_is_the_causal_window():
    causal = masks.sliding_window(4).materialize(1, 1, 7, 7)
    assert torch.equal(masks.sliding_window(4, ahead=0).materialize(1, 1, 7, 7), causal)
    assert torch.equal(causal[0, 0], flash_window(7, 7, 0, 3, 0))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("T", "S", "q_offset", "left", "right"), CASES)
def test_every_backend_equals_the_dense_fp64_reference(backend, T, S, q_offset, left, right):
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, T, S, seed=T + S + left))
    dense = flash_window(T, S, q_offset, left, right)
    mask = masks.sliding_window(left + 1, ahead=right)
    got = dikkat.attention(q, k, v, mask, q_offset=q_offset, backend=backend)
    want = dikkat.attention(q, k, v, dense, q_offset=q_offset, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    empty = ~dense.any(-1)  # rows that see no key give 0
    assert (got[:, :, empty] == 0).all()
    dout = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, torch.autograd.grad(want, (q, k, v), dout), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("windows", [None, True, False])
@pytest.mark.parametrize(("T", "S", "q_offset", "left", "right"), CASES)
def test_tiled_with_small_tiles_equals_the_reference(windows, T, S, q_offset, left, right):
    """Many blocks and key tiles, gathered windows (some running past the last key) or rows."""
    q, k, v = (t.requires_grad_() for t in qkv(2, 2, 1, T, S, seed=T * S))
    mask = masks.sliding_window(left + 1, ahead=right)
    out, lse = tiled.tiled_attention(
        q, k, v, mask, scale=0.25, q_offset=q_offset, block=8, key_tile=16, windows=windows,
        plans=tiled.PlanCache(),
    )  # fmt: skip
    dense = flash_window(T, S, q_offset, left, right)
    want, (_, want_lse) = dikkat.attention(
        q, k, v, dense, scale=0.25, q_offset=q_offset, backend="reference", return_lse=True
    )
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    dout = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def computed(mask, n: int, **kwargs) -> tiled.PlanSummary:
    q = torch.empty(1, 1, n, 1)
    return tiled.plan_summary(q, q, mask, block=64, plans=tiled.PlanCache(), **kwargs)


def test_tiled_skips_what_the_band_hides():
    n, w, r, b = 2048, 64, 32, 64
    band = computed(masks.sliding_window(w, ahead=r), n)
    assert band.kind == "windows"
    # each block of b rows: its w − 1 keys back, its own b, r ahead, in windows of whole blocks
    width = -(-(w - 1 + b + r) // b) * b
    assert band.computed_cells <= n * width < n * n / 10
    cells = [computed(masks.sliding_window(w, ahead=r), m).computed_cells for m in (n, 2 * n)]
    assert cells[1] <= 2 * cells[0] + 2 * b * (w + r + b)  # linear in n
    rows = computed(masks.sliding_window(w, ahead=r), n, windows=False, key_tile=128, cells=b * 128)
    assert rows.kind == "rows" and rows.computed_fraction < 0.25


def test_kv_range_reaches_the_keys_ahead():
    mask = masks.sliding_window(3, ahead=5)
    assert mask.kv_range(10, 20, 100) == (8, 25)
    assert mask.kv_range(10, 20, 22) == (8, 22)  # stops at the last key
    assert mask.kv_range(-9, -6, 100) == (0, 0)  # queries before key 0 that see none of it
    assert mask.kv_range(-4, -1, 100) == (0, 4)  # … and ones that see the first keys ahead


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["tiled", *(("flex",) if HAS_FLEX else ())])
def test_the_caches_tell_windows_apart_by_ahead(backend):
    """Plans and block masks are cached per mask's parameters: a window with another ``ahead``
    must not reuse the one without it."""
    q, k, v = qkv(1, 2, 2, 24, 24, seed=1)
    for ahead in (0, 4, 0):
        got = dikkat.attention(q, k, v, masks.sliding_window(5, ahead=ahead), backend=backend)
        dense = flash_window(24, 24, 0, 4, ahead)
        want = dikkat.attention(q, k, v, dense, backend="reference")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("window", "q_offset", "flag"), [(8, 0, True), (8, 3, False), (5, 0, False)]
)
def test_sdpa_runs_a_window_that_hides_nothing_more_as_causal(monkeypatch, window, q_offset, flag):
    """A causal window reaching back past key 0 from every query is the causal mask: SDPA gets
    its ``is_causal`` flag (no dense mask to build), with the reference's result."""
    from dikkat.core import sdpa as sdpa_module

    seen = []
    sdpa = sdpa_module.TORCH_SDPA  # torch's own function, which the backend holds

    def spy(*args, **kwargs):
        seen.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(sdpa_module, "TORCH_SDPA", spy)
    T, S = 6, 6 + q_offset
    q, k, v = torch.randn(1, 2, T, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
    mask = masks.sliding_window(window)
    got = dikkat.attention(q, k, v, mask, q_offset=q_offset, backend="sdpa")
    want = dikkat.attention(q, k, v, mask, q_offset=q_offset, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert seen == [(flag, flag)]  # the flag and no mask, or a dense mask and no flag
