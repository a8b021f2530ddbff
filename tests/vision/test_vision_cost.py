"""The cost figures against counting: score cells of a real attention call, FLOPs through
``torch.utils.flop_counter`` over the real modules, bytes of the real tensors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dikkat import attention
from dikkat.cli import main
from dikkat.vision.cost import vision_cost
from dikkat.vision.psa import Attention

IMGSZ, WIDTH, HEADS = 64, 16, 2  # maps 8×8, 4×4, 2×2; hd 8, kd 4


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("row", vision_cost(IMGSZ, WIDTH, HEADS), ids=lambda r: f"stride{r.stride}")
def test_figures_match_counting(row):
    side = IMGSZ // row.stride
    x = torch.randn(1, WIDTH, side, side)
    # the tokens and score cells of the attention a PSA block actually computes
    q = torch.randn(1, HEADS, side * side, row.key_dim)
    v = torch.randn(1, HEADS, side * side, row.head_dim)
    _, (weights, _) = attention(q, q, v, backend="reference", return_weights=True)
    assert weights.shape[-1] == row.tokens
    assert weights.numel() == row.score_cells
    assert weights.numel() * weights.element_size() == row.score_bytes
    core = counted_flops(lambda: attention(q, q, v, backend="reference"))
    assert core == row.attention_flops
    block = Attention(WIDTH, num_heads=HEADS).eval()
    assert counted_flops(lambda: block(x)) == row.block_flops
    conv = torch.nn.Conv2d(WIDTH, WIDTH, 3, padding=1, bias=False)
    assert counted_flops(lambda: conv(x)) == row.conv_flops
    out = conv(x)
    assert out.numel() * out.element_size() == row.conv_bytes


def test_stride_32_at_640_is_the_seeds_400_tokens():
    rows = {r.stride: r for r in vision_cost(640)}
    assert [(s, rows[s].side, rows[s].tokens) for s in (8, 16, 32)] == [
        (8, 80, 6400),
        (16, 40, 1600),
        (32, 20, 400),
    ]
    assert rows[8].score_cells == 256 * rows[32].score_cells  # 16× the tokens, 256× the cells
    assert rows[8].attention_flops > rows[8].conv_flops  # attention dearer than a conv…
    assert rows[32].attention_flops < rows[32].conv_flops  # …except at stride 32


def test_cli_prints_the_table(capsys):
    assert main(["vision-cost", "--imgsz", "640"]) == 0
    out = capsys.readouterr().out
    assert "20×20" in out and "80×80" in out
    stride32 = next(line for line in out.splitlines() if line.strip().startswith("32 "))
    assert "400" in stride32 and "320,000" in stride32  # 2 heads · 400²


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--imgsz", "100"], "not a multiple of stride 32"),
        (["--width", "128", "--heads", "3"], "heads 3 does not divide width 128"),
        (["--width", "0"], "expected a positive integer"),
    ],
)
def test_cli_bad_arguments_give_one_line(capsys, argv: list[str], words: str):
    try:
        code = main(["vision-cost", *argv])
    except SystemExit as e:  # argparse's own errors exit
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.count("\n") == 1
