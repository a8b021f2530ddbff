"""The cost table against counting: the score cells and bytes of a real reference call, the
bytes of real q, k, v, and of the buffers the tiled model names."""

from __future__ import annotations

import pytest
import torch

from dikkat import attention
from dikkat.bench.cost import DEFAULT_NS, attention_cost, format_bytes, format_cost_table
from dikkat.cli import main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("B", "H", "n", "D"), [(1, 2, 16, 4), (2, 3, 24, 8)])
def test_score_figures_match_a_reference_call(dtype, B, H, n, D):
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype) for _ in range(3))
    _, (weights, _) = attention(q, k, v, backend="reference", return_weights=True)
    cost = attention_cost(n, H, D, q.element_size(), B=B)
    assert weights.shape[-2:] == (n, n)
    assert weights[0, 0].numel() == cost.score_cells_per_head
    assert weights[0, 0].numel() * weights.element_size() == cost.score_bytes_per_head
    assert weights.numel() == cost.score_cells
    assert weights.numel() * weights.element_size() == cost.score_bytes
    assert sum(t.numel() * t.element_size() for t in (q, k, v)) == cost.qkv_bytes


def test_tiled_bytes_are_its_named_buffers():
    B, H, n, D, cells = 2, 3, 40, 8, 16 * 16
    accumulator = torch.zeros(B, H, n, D)  # fp32 weighted sum of values
    lse = torch.zeros(B, H, n)  # log-sum-exp per row
    tile = torch.zeros(cells)  # one tile of scores (or its mask), all heads
    held = sum(t.numel() * t.element_size() for t in (accumulator, lse, tile))
    assert attention_cost(n, H, D, 2, B=B, tile_cells=cells).tiled_bytes == held


def test_the_seeds_32k_claim():
    """The issue's figure: 4 GiB per head, 32 GiB for 8 heads, at n = 32768 in fp32."""
    cost = attention_cost(32768, 8, 64, 4)
    assert (
        cost.score_bytes_per_head
        == 32768 * 32768 * torch.empty((), dtype=torch.float32).element_size()
    )
    assert format_bytes(cost.score_bytes_per_head) == "4 GiB"
    assert format_bytes(cost.score_bytes) == "32 GiB"
    assert cost.tiled_bytes < cost.score_bytes_per_head / 50


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="n must be a positive integer"):
        attention_cost(bad)


def test_format_bytes_uses_binary_units():
    assert [format_bytes(x) for x in (512, 1536, 2**20, 3 * 2**40)] == [
        "512 B",
        "1.5 KiB",
        "1 MiB",
        "3 TiB",
    ]


def test_table_has_a_line_per_n():
    lines = format_cost_table(DEFAULT_NS).splitlines()
    for n in DEFAULT_NS:
        assert sum(line.lstrip().startswith(f"{n:,} ") for line in lines) == 1


def test_cli_prints_the_table(capsys):
    assert main(["bench", "cost", "--n", "1024", "32768", "--heads", "4"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("32,768"))
    assert "4 GiB" in row and "16 GiB" in row  # per head, and 4 heads in fp32
