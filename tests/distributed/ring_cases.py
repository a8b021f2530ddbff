"""What each spawned rank of tests/distributed/test_ring_attention.py runs: every case in one
process group, each compared with the fp64 reference on the whole sequence, regenerated on every
rank from one seed. An assertion raises in the child, which fails the test."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dikkat
from dikkat import masks
from dikkat.distributed import RingStats, gather_sequence, ring_attention, shard_sequence
from layouts import Layout, relaid, values
from spawning import gloo_group

B, H, G, D, DV = 2, 4, 2, 8, 6
T = 37  # divides by neither 2·2 nor 2·4 chunks: the first chunks are one longer
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def mask_cases(n: int) -> dict[str, masks.Mask | None]:
    ids = torch.tensor([0] * 10 + [1] * 15 + [2] * (n - 25))
    return {
        "none": None,
        "causal": masks.causal(),
        "sliding_window(5)": masks.sliding_window(5),
        "document": masks.document(ids),
        "padding": masks.padding(torch.tensor([20, 0])),  # batch row 1 sees no key at all
        "prefix_lm(9)": masks.prefix_lm(9),
    }


def expect_value_error(fn, *needles: str) -> None:
    try:
        fn()
    except ValueError as e:
        assert all(n in str(e) for n in needles), str(e)
    else:
        raise AssertionError(f"no ValueError (expected one naming {needles})")


def full_tensors(
    seed: int, s: int = T, t: int = T, kv: tuple[int, int] = (G, DV)
) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient of the whole sequence; ``kv``: (G, Dv)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, t, D, generator=g, dtype=torch.float64),
        torch.randn(B, kv[0], s, D, generator=g, dtype=torch.float64),
        torch.randn(B, kv[0], s, kv[1], generator=g, dtype=torch.float64),
        torch.randn(B, H, t, kv[1], generator=g, dtype=torch.float64),  # the output's gradient
    )


def check_case(
    name: str, mask, layout: str, dtype: torch.dtype, seed: int, s: int = T, t: int = T,
    lay: dict[str, Layout] | None = None, kv: tuple[int, int] = (G, DV),
) -> None:  # fmt: skip
    """``lay``: the memory layouts (tests/layouts.py) of the local q, k, v and output gradient,
    each from the values it gives the whole sequence (an expanded one repeats a slice along a
    dim other than the sequence's); None: as shard_sequence cuts them."""
    q, k, v, dout = full_tensors(seed, s, t, kv)
    if lay is not None:
        q, k, v, dout = values({"q": q, "k": k, "v": v, "dout": dout}, lay).values()
    q, k, v = (t.to(dtype).double().requires_grad_() for t in (q, k, v))  # same values as dtype
    ref, aux = dikkat.attention(q, k, v, mask, backend="reference", return_lse=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert ref.abs().max() > 0.1, name  # the comparison is not trivially true

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t.detach(), 2, layout)

    def laid(t: torch.Tensor, name: str) -> torch.Tensor:  # this rank's shard, in dtype and layout
        return shard(t).to(dtype) if lay is None else relaid(shard(t).to(dtype), *lay[name])

    local = [laid(t, n).detach().requires_grad_() for n, t in zip("qkv", (q, k, v), strict=True)]
    out, lse = ring_attention(*local, mask, layout=layout, return_lse=True)
    grads = torch.autograd.grad(out, local, laid(dout, "dout"))
    tol = TOL[dtype]
    where = f"{name}, {layout}, {dtype}, rank {dist.get_rank()}"
    assert out.dtype == dtype and lse.shape == out.shape[:3], where
    torch.testing.assert_close(out.double(), shard(ref), rtol=tol, atol=tol, msg=where)
    torch.testing.assert_close(lse.double(), shard(aux.lse), rtol=tol, atol=tol, msg=where)
    for label, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(
            got.double(), shard(want), rtol=tol, atol=tol, msg=f"d{label}: {where}"
        )


def check_errors(rank: int, world: int) -> None:
    q = torch.zeros(B, H, 4, D)
    k = v = torch.zeros(B, G, 4, D)
    expect_value_error(lambda: ring_attention(q, k, v, layout="stripes"), "layout", "stripes")
    longer = torch.zeros(B, H, 10 if rank == 0 else 4, D)  # rank 0 holds too many queries
    expect_value_error(lambda: ring_attention(longer, k, v), "q shards", "zigzag")
    three = torch.zeros(B, 3, 4, D)
    expect_value_error(lambda: ring_attention(q, three, three), "3 heads")
    # a NaN on the last rank alone: every rank raises (none waits on the others), naming it
    bad = q.clone()
    bad[0, 0, 0, 0] = float("nan") if rank == world - 1 else 0.0
    expect_value_error(lambda: ring_attention(bad, k, k), "NaN", f"[{world - 1}]")


def check_layouts() -> None:
    x = torch.arange(3 * T).view(3, T)
    for layout in ("zigzag", "contiguous"):
        shard = shard_sequence(x, 1, layout)
        assert torch.equal(gather_sequence(shard, 1, layout), x), layout
        assert torch.equal(gather_sequence(shard_sequence(x.T, 0, layout), 0, layout), x.T)


def check_skipped_blocks(rank: int) -> None:
    """4 ranks, 32 positions, a window of 3: each chunk's queries see only their own chunk and
    the one before it."""
    want = {
        "contiguous": (1, [0] if rank == 0 else [rank - 1, rank]),  # chunks of 8
        # chunks of 4; rank i holds chunks i and 7 − i, whose neighbours are on ranks i ± 1
        "zigzag": (3, {0: [0, 1], 1: [0, 1, 2], 2: [1, 2, 3], 3: [2, 3]}[rank]),
    }
    q, k, v, _ = full_tensors(7, 32, 32)
    for layout, (steps, by_rank) in want.items():
        stats = RingStats()
        local = [shard_sequence(t, 2, layout) for t in (q, k, v)]
        ring_attention(*local, masks.sliding_window(3), layout=layout, stats=stats)
        assert stats.ring_steps == steps, (layout, stats)
        assert stats.computed_by_rank == by_rank, (layout, stats)
        assert stats.blocks_computed + stats.blocks_skipped == 4, stats


# q, k, v and the output's gradient of every rank as views whose strides are not the shards'
# (tests/layouts.py): transposed, sliced, channels-last, expanded over a dim other than the
# sequence's; (mask, layouts, (G, Dv)): with G = H and Dv = D the views reach the tiled
# backend's fused kernel as they are
RELAID = {
    "causal": (masks.causal(), {"q": ("transposed", 0), "k": ("every_other", 0),
               "v": ("channels_last", 0), "dout": ("expanded", 3)}, (H, D)),
    "sliding_window(5)": (masks.sliding_window(5), {"q": ("column_major", 0),
                          "k": ("transposed", 0), "v": ("narrowed", 0),
                          "dout": ("expanded", 1)}, (H, D)),
    "none": (None, {"q": ("channels_last", 0), "k": ("expanded", 0), "v": ("expanded", 3),
             "dout": ("transposed", 0)}, (G, DV)),
}  # fmt: skip


def run(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    q = torch.zeros(1, 1, 2, 4)
    expect_value_error(lambda: ring_attention(q, q, q), "init_process_group")
    with gloo_group(rank, world, port):
        check_errors(rank, world)
        check_layouts()
        seed = 0
        for dtype in (torch.float64, torch.float32):
            for layout in ("zigzag", "contiguous"):
                for name, mask in mask_cases(T).items():
                    seed += 1
                    check_case(name, mask, layout, dtype, seed)
                check_case("causal, S ≠ T", masks.causal(), layout, dtype, seed, s=23)
                # fewer positions than chunks: some ranks hold one chunk or none
                check_case("causal, T = S = 5", masks.causal(), layout, dtype, seed, s=5, t=5)
        if world == 2:  # shards longer than one backward tile of rows
            window = masks.sliding_window(40)
            check_case("sliding_window(40), T = 600", window, "contiguous", torch.float64, 99,
                       s=600, t=600)  # fmt: skip
            for name, (mask, lay, kv) in RELAID.items():  # strided shards
                for dtype in (torch.float64, torch.float32):
                    check_case(f"{name}, shards laid out {lay}", mask, "zigzag", dtype, seed,
                               lay=lay, kv=kv)  # fmt: skip
        if world == 4:
            check_skipped_blocks(rank)
