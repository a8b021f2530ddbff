"""The tiled backend with many tiles: exact in fp64, masked tiles skipped, lse, O(n) memory.

``test_backends.py`` runs every backend (this one included) under the 2× error rule on short
sequences, which fit in one tile; here small tiles force the online-softmax rescaling, tile
skipping, gathered windows and per-tile masks through every mask kind.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dikkat
from dikkat import masks
from dikkat.core import cache_sizes, clear_caches, tiled, tuning
from dikkat.core.masks import as_mask
from dikkat.core.tiled.cache import prepare
from helpers import Case, attention_cases, oracle


def run_tiled(
    case: Case,
    inputs,
    block: int,
    key_tile: int = 4096,
    cells: int = 1 << 22,
    windows: bool | None = None,
    fused: bool | None = None,
):
    q, k, v = (inputs[n].clone().requires_grad_() for n in "qkv")
    mask = None if case.mask is None else as_mask(case.mask, case.q_offset)
    if mask is not None and mask.is_full:
        mask = None
    out, lse = tiled.tiled_attention(
        q,
        k,
        v,
        mask,
        scale=1 / math.sqrt(case.D),
        bias=inputs["bias"],
        q_offset=case.q_offset,
        block=block,
        key_tile=key_tile,
        cells=cells,
        windows=windows,
        fused=fused,
    )
    grads = torch.autograd.grad(out, (q, k, v), inputs["dout"])
    return out.detach(), lse, grads


@given(
    case=attention_cases(max_len=40),
    block=st.sampled_from([1, 3, 8, 16]),
    key_tile=st.sampled_from([1, 5, 16, 4096]),
    cells=st.sampled_from([1, 50, 400, 1 << 22]),
    windows=st.sampled_from([None, False, True]),
    fused=st.sampled_from([None, False]),
)
def test_many_tiles_equal_the_fp64_reference(case, block, key_tile, cells, windows, fused):
    """Every way of cutting the work — rows or gathered windows, one or many key tiles, one
    or many blocks per tile, each tile in the fused kernel (where it can run) or in plain
    tensor ops — gives the reference's output, gradients and lse."""
    inputs = case.inputs()
    exact = oracle(case, inputs, torch.float64)
    out, lse, (dq, dk, dv) = run_tiled(case, inputs, block, key_tile, cells, windows, fused)
    for got, want in ((out, exact.out), (dq, exact.dq), (dk, exact.dk), (dv, exact.dv)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    # the log-sum-exp of each row, -inf where no key is allowed
    _, (_, ref_lse) = dikkat.attention(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        case.mask,
        bias=inputs["bias"],
        q_offset=case.q_offset,
        backend="reference",
        return_weights=True,
        return_lse=True,
    )
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-10, rtol=1e-10)


def computed_cells(mask, T: int, S: int, block: int, key_tile: int, windows=None) -> int:
    """Score cells the forward pass computes under the plan (skipped key tiles excluded), with
    tiles of block × key_tile cells."""
    q = k = torch.empty(1, 1, max(T, S), 1)
    summary = tiled.plan_summary(
        q[:, :, :T], k[:, :, :S], mask, block=block, key_tile=key_tile, cells=block * key_tile,
        windows=windows, plans=tiled.PlanCache(),
    )  # fmt: skip
    assert summary.total_cells == T * S
    return summary.computed_cells


def test_hidden_work_is_skipped():
    n, b = 2048, 64
    assert computed_cells(None, n, n, b, 256) == n * n
    causal = computed_cells(masks.causal(), n, n, b, 256) / (n * n)
    assert 0.5 <= causal <= 0.6  # about half
    # a sliding window or packed documents: gathered windows, work linear in n
    for w in (64, 256):
        window = computed_cells(masks.sliding_window(w), n, n, b, 4096)
        assert window <= n * (w + b)  # each block: its w − 1 keys back plus its own
        cells = [computed_cells(masks.sliding_window(w), m, m, b, 4096) for m in (n, 2 * n, 4 * n)]
        assert cells[2] - cells[1] == 2 * (cells[1] - cells[0])  # a constant cost per block
    docs = masks.document(torch.arange(n) // (n // 8))  # 8 packed documents
    assert computed_cells(docs, n, n, b, 4096) <= n * (n // 8 + b)
    # forbidding windows falls back to rows, which still skip what kv_range excludes
    assert computed_cells(masks.sliding_window(64), n, n, b, 256, windows=False) < n * n / 4


def test_masked_key_tiles_are_skipped_not_computed():
    """A causal plan of rows skips the key tiles above the diagonal: the summary counts them,
    and its cells are what the skipped tiles leave."""
    n, b, kt = 1024, 64, 128
    q = torch.empty(1, 1, n, 1)
    full = tiled.plan_summary(q, q, None, block=b, key_tile=kt, cells=b * kt)
    causal = tiled.plan_summary(q, q, masks.causal(), block=b, key_tile=kt, cells=b * kt)
    assert full.skipped_tiles == 0 and full.computed_fraction == 1.0
    assert causal.kind == full.kind == "rows"
    assert causal.skipped_tiles == 0  # kv_range already stops each run of rows at its diagonal
    prefix = tiled.plan_summary(q, q, ~masks.causal(), block=b, key_tile=kt, cells=b * kt)
    assert prefix.skipped_tiles > 0  # ~causal reports no key range: its hidden tiles are skipped
    assert prefix.computed_cells + prefix.skipped_tiles * b * kt == n * n
    empty = tiled.plan_summary(q[:, :, :0], q, masks.causal())
    assert empty.kind == "empty" and empty.tiles == 0 and empty.computed_fraction == 0.0


def test_plans_choose_windows_only_for_sliding_ranges():
    def kinds(mask, n=1024):
        q = torch.empty(1, 8, n, 1)
        return tiled.plan_summary(q, q, mask, block=128, cells=1 << 22, key_tile=4096).kind

    assert kinds(None) == kinds(masks.causal()) == "rows"
    assert kinds(masks.sliding_window(256)) == "windows"
    assert kinds(masks.document(torch.arange(1024) // 128)) == "windows"
    assert kinds(masks.sliding_window(1000)) == "rows"  # windows would not save half


def test_extra_memory_stays_linear():
    """Autograd keeps q, k, v, out and the lse: no T × S tensor, unlike the reference."""
    T = 1024
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        dikkat.attention(q, k, v, masks.causal(), backend="tiled")
    assert max(saved) <= 2 * T * 16  # the biggest saved tensor is (B, H, T, D)-sized
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        dikkat.attention(q, k, v, masks.causal(), backend="reference")
    assert max(saved) >= 2 * T * T  # the reference keeps the (B, H, T, S) weights


def test_return_lse_and_refusals():
    q = k = v = torch.randn(1, 2, 5, 8)
    _, (_, lse) = dikkat.attention(q, k, v, masks.causal(), backend="tiled", return_lse=True)
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="use return_lse"):
        dikkat.attention(q, k, v, backend="tiled", return_weights=True)
    with pytest.raises(ValueError, match="no dropout"):
        dikkat.attention(q, k, v, backend="tiled", dropout=0.1)
    with pytest.raises(ValueError, match="cannot return the log-sum-exp"):
        dikkat.attention(q, k, v, backend="sdpa", return_lse=True)
    for name in ("block", "key_tile", "cells"):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            tiled.tiled_attention(q, k, v, scale=1.0, **{name: 0})


@given(case=attention_cases(max_len=40), data=st.data())
def test_kv_range_bounds_every_visible_key(case, data):
    """No mask allows a key outside the range it reports (the tiled backend relies on it)."""
    if case.mask is None:
        return
    mask = as_mask(case.mask, case.q_offset)
    a = data.draw(st.integers(0, case.T - 1))
    b = data.draw(st.integers(a + 1, case.T))
    q0, q1 = case.q_offset + a, case.q_offset + b
    lo, hi = mask.kv_range(q0, q1, case.S)
    allowed = case.allowed()[:, :, a:b]  # (B, H, b − a, S)
    visible = allowed.any(dim=(0, 1, 2)).nonzero().flatten().tolist()
    assert all(lo <= j < hi for j in visible), (lo, hi, visible)


@given(case=attention_cases(max_len=40), data=st.data())
def test_kv_full_range_holds_only_keys_every_query_sees(case, data):
    """Every key of the range a mask says every query sees is allowed to each query, in
    every batch row and head: the tiled backend runs those tiles without a mask."""
    if case.mask is None:
        return
    mask = as_mask(case.mask, case.q_offset)
    a = data.draw(st.integers(0, case.T - 1))
    b = data.draw(st.integers(a + 1, case.T))
    lo, hi = mask.kv_full_range(case.q_offset + a, case.q_offset + b, case.S)
    assert lo >= hi or (lo >= 0 and hi <= case.S)
    allowed = case.allowed()[:, :, a:b]  # (B, H, b − a, S)
    assert bool(allowed[..., lo:hi].all()), (lo, hi)


def test_the_part_of_a_window_every_row_sees_runs_unmasked():
    """A window wider than a key tile: each run of rows is cut where the part every row sees
    starts and ends, so only its two edges build masks; the result is the reference's."""
    n, w, b = 640, 300, 64
    mask = masks.sliding_window(w)
    assert mask.kv_full_range(400, 464, n) == (464 - w, 401)
    assert (masks.causal() & mask).kv_full_range(400, 464, n) == (464 - w, 401)
    assert masks.padding(torch.tensor([7, 5])).kv_full_range(0, 4, 9) == (0, 5)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(3))
    cache, tiling = tiled.PlanCache(), dict(block=b, key_tile=256, cells=2 * b * 256)
    prepared = prepare(
        mask, (1, 2, 2, n, n), 0, **tiling, windows=False, dtype=q.dtype, device=q.device,
        cache=cache,
    )  # fmt: skip
    out, _ = tiled.tiled_attention(q, k, v, mask, scale=0.3, **tiling, windows=False, plans=cache)
    assert cache.hits == 1  # the call ran the plan above
    assert [item.r1 - item.r0 for item in prepared.plan] == [b] * (n // b)
    for item in prepared.plan:  # rows r0 … r0 + b − 1 all see keys r0 + b − w … r0
        full = sum(k1 - k0 for k0, k1, seen in item.key_tiles(256) if seen)
        assert full == (w - b + 1 if item.r0 + b >= w else item.r0 + 1)
    # every tile mask kept is an edge's: at most one block of rows by one block of keys wide
    assert all(
        t.additive is None or t.additive.shape[-1] <= b for t in prepared.masks.kept.values()
        if not isinstance(t, bool)
    )  # fmt: skip
    ref, _ = dikkat.attention(q, k, v, mask, scale=0.3, backend="reference", return_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@given(case=attention_cases(max_len=30), data=st.data())
def test_attention_weights_from_the_lse_equal_the_reference(case, data):
    """Chosen rows and heads, recomputed from the tiled backend's lse, = the reference weights."""
    inputs = case.inputs()
    q, k, v, bias = inputs["q"], inputs["k"], inputs["v"], inputs["bias"]
    kwargs = {"bias": bias, "q_offset": case.q_offset}
    _, (_, lse) = dikkat.attention(q, k, v, case.mask, backend="tiled", return_lse=True, **kwargs)
    _, (ref, _) = dikkat.attention(
        q, k, v, case.mask, backend="reference", return_weights=True, **kwargs
    )
    rows = data.draw(st.lists(st.integers(0, case.T - 1), min_size=1, max_size=4))
    heads = data.draw(st.lists(st.integers(0, case.H - 1), min_size=1, max_size=3))
    w = dikkat.attention_weights(q, k, lse, rows=rows, heads=heads, mask=case.mask, **kwargs)
    assert w.shape == (case.B, len(heads), len(rows), case.S)
    torch.testing.assert_close(w, ref[:, heads][:, :, rows], atol=1e-12, rtol=1e-10)


def test_attention_weights_bad_input():
    q = k = torch.randn(1, 2, 4, 8)
    lse = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="lse must have shape"):
        dikkat.attention_weights(q, k, lse[..., :3])
    with pytest.raises(ValueError, match="rows must index 0 … 3"):
        dikkat.attention_weights(q, k, lse, rows=[4])
    with pytest.raises(ValueError, match="heads must index 0 … 1"):
        dikkat.attention_weights(q, k, lse, heads=[-1])


def test_auto_sends_mostly_hidden_masks_to_tiled():
    q, k, v = (torch.randn(1, 1, 1024, 16) for _ in range(3))
    window = masks.sliding_window(64)
    assert dikkat.explain(q, k, v, window).startswith("tiled (not sdpa: the mask leaves at most")
    assert dikkat.explain(q, k, v, masks.causal()).startswith("sdpa")  # SDPA's causal kernel
    assert dikkat.explain(q, k, v).startswith("sdpa")
    small = q[:, :, :64], k[:, :, :64], v[:, :, :64]
    assert dikkat.explain(*small, window).startswith("sdpa")  # too small to matter
    torch.testing.assert_close(
        dikkat.attention(q, k, v, window), dikkat.attention(q, k, v, window, backend="tiled")
    )


def _qkv(n: int, seed: int = 0, heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def test_masks_are_prepared_once_and_rebuilt_when_they_change():
    """A repeated call with an equal mask reuses the plan and its tile masks; a mask tensor
    changed in place, or a mask type of the caller's own, is evaluated again."""
    plans = tiled.PlanCache()
    n = 512
    q, k, v = _qkv(n)
    ids = torch.arange(n) // 100
    docs = masks.document(ids)
    first = tiled.tiled_attention(q, k, v, docs, scale=0.3, block=32, plans=plans)[0]
    assert (plans.builds, plans.hits) == (1, 0)
    again = tiled.tiled_attention(q, k, v, masks.document(ids), scale=0.3, block=32, plans=plans)
    assert (plans.builds, plans.hits) == (1, 1) and torch.equal(first, again[0])
    ids.copy_(torch.arange(n) // 50)  # the same tensor, new documents
    changed = tiled.tiled_attention(q, k, v, docs, scale=0.3, block=32, plans=plans)[0]
    assert plans.builds == 2
    ref = dikkat.attention(q, k, v, masks.document(ids.clone()), backend="reference", scale=0.3)
    torch.testing.assert_close(changed, ref, rtol=1e-10, atol=1e-10)

    class Lower(masks.Mask):  # a mask of the caller's own: never cached
        def predicate(self, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    lower = Lower()
    for _ in range(2):
        tiled.tiled_attention(q, k, v, lower, scale=0.3, block=32, plans=plans)
    assert plans.builds == 4 and len(plans) == 2


def test_the_shared_plan_cache_and_clear_caches():
    """Without ``plans=`` calls share :data:`tiled.plans`; ``clear_caches`` empties it (and
    every other cache dikkat keeps) without changing a result."""
    q, k, v = _qkv(256)
    window = masks.sliding_window(32)
    first = tiled.tiled_attention(q, k, v, window, scale=0.3)[0]
    assert cache_sizes()["tiled plans"] >= 1
    clear_caches()
    assert tiled.plans.builds == 0 and set(cache_sizes().values()) == {0}
    assert torch.equal(tiled.tiled_attention(q, k, v, window, scale=0.3)[0], first)
    assert tiled.plans.builds == 1


def test_window_tiles_keep_one_block_pattern():
    """Every block of a sliding window sees the same pattern over its own window: the kept
    masks hold one block's worth per tile, not one per block."""
    n, w = 4096, 256
    q, k, v = _qkv(n)
    plans = tiled.PlanCache()
    tiled.tiled_attention(q, k, v, masks.sliding_window(w), scale=0.3, plans=plans)
    summary = tiled.plan_summary(q, k, masks.sliding_window(w), plans=plans)
    assert plans.hits == 1  # the summary reports the plan the call ran
    block = summary.block
    assert summary.kind == "windows" and block == tiled.BLOCK // 2  # narrow band: small blocks
    assert summary.windows == n // block  # every block has its own window, in some tile
    one_block_each = summary.tiles * block * (w + block) * 8  # fp64, widths ≤ w − 1 + block
    assert 0 < summary.kept_mask_bytes <= one_block_each < n * w * 8 / 8


@pytest.mark.parametrize("kept", [0, 1 << 30])
def test_unkept_masks_give_the_same_result(kept: int):
    """Tile masks rebuilt at every use (nothing kept) or all kept: bit-identical results."""
    n = 300
    q, k, v = (t.requires_grad_() for t in _qkv(n, seed=3))
    dout = torch.randn(1, 2, n, 8, dtype=torch.float64)
    runs = []
    for limit in (kept, 16 << 20):
        plans = tiled.PlanCache(kept_mask_bytes=limit)
        for mask in (masks.sliding_window(40), masks.causal(), masks.prefix_lm(70)):
            out, _ = tiled.tiled_attention(
                q, k, v, mask, scale=0.3, block=16, key_tile=64, plans=plans
            )
            runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        kept_bytes = tiled.plan_summary(q, k, masks.causal(), block=16, key_tile=64, plans=plans)
        assert (kept_bytes.kept_mask_bytes == 0) == (limit == 0)
    half = len(runs) // 2
    for a, b in zip(runs[:half], runs[half:], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_block_size_follows_the_cells_it_saves():
    """On CPU, windows pick the block size with the least kernel time (cells over the kernel's
    measured speed at that many rows, ``tuning.CPU.rows_speed``): small blocks for a narrow
    band, large ones for 1024-token documents."""
    n = 8192
    q = torch.empty(1, 8, n, 1)

    def block(mask, **kwargs) -> int:
        return tiled.plan_summary(q, q, mask, plans=tiled.PlanCache(), **kwargs).block

    assert tuning.for_device(q.device) is tuning.CPU
    assert block(masks.sliding_window(256)) == tiled.BLOCK // 2
    assert block(masks.document(torch.arange(n) // 1024)) == 2 * tiled.BLOCK
    assert block(masks.causal()) == block(None) == tiled.BLOCK
    assert block(masks.sliding_window(256), windows=False) == tiled.BLOCK
    assert block(masks.sliding_window(256), block=32) == 32  # a given block is kept


def test_fused_is_an_argument():
    """fused=False runs plain tensor ops, None the fused CPU kernel where it can run, True
    insists on it: an error naming the reason where it cannot (here Dv ≠ D)."""
    q, k, v = _qkv(64)
    window = masks.sliding_window(8)
    outs = [
        tiled.tiled_attention(q, k, v, window, scale=0.3, fused=f)[0] for f in (None, True, False)
    ]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-12, atol=1e-12)
    wide = torch.randn(1, 2, 64, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fused=True.*Dv = 5 and q D = 8"):
        tiled.tiled_attention(q, k, wide, window, scale=0.3, fused=True)
    plain = tiled.tiled_attention(q, k, wide, window, scale=0.3)[0]  # None: plain ops here
    assert plain.shape == (1, 2, 64, 5)
