"""The object-query detector: boxes, Hungarian matching, the set loss, attention maps, training,
saving, and the `train --task shapes` / `detect` commands."""

import itertools
import math

import pytest
import torch

from dikkat.tasks import TaskSpec, build_task
from dikkat.tasks.shapes import ShapesTask
from dikkat.training.trainer import TrainConfig, Trainer
from dikkat.vision.detr import (
    DETR,
    DETRConfig,
    DETROutput,
    LossWeights,
    box_iou,
    detr_loss,
    generalized_box_iou,
    hungarian_match,
)
from dikkat.vision.shapes import ShapesConfig, make_batch
from helpers import run_cli

SMALL = {"width": 8, "d_model": 32, "n_layers": 2, "n_heads": 2}


def _corners(b):
    cx, cy, w, h = b
    return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2


def _giou(a, b):
    """GIoU of two (cx, cy, w, h) boxes, written out for one pair."""
    ax0, ay0, ax1, ay1 = _corners(a)
    bx0, by0, bx1, by1 = _corners(b)
    inter = max(0.0, min(ax1, bx1) - max(ax0, bx0)) * max(0.0, min(ay1, by1) - max(ay0, by0))
    union = (ax1 - ax0) * (ay1 - ay0) + (bx1 - bx0) * (by1 - by0) - inter
    hull = (max(ax1, bx1) - min(ax0, bx0)) * (max(ay1, by1) - min(ay0, by0))
    return inter / union - (hull - union) / hull


def test_iou_and_giou_of_known_pairs():
    a = torch.tensor([[0.25, 0.25, 0.5, 0.5]])  # [0, 0.5]²
    b = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.9, 0.9, 0.1, 0.1], [0.25, 0.25, 0.5, 0.5]])
    iou, giou = box_iou(a, b)[0], generalized_box_iou(a, b)[0]
    assert iou.tolist() == pytest.approx([0.0625 / 0.4375, 0.0, 1.0])
    assert giou[0].item() == pytest.approx(1 / 7 - (0.5625 - 0.4375) / 0.5625)
    assert giou[1].item() == pytest.approx(0.26 / 0.9025 - 1)  # disjoint: below 0
    assert giou[2].item() == pytest.approx(1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 4, generator=g) * 0.5 + 0.1
    y = torch.rand(3, 4, generator=g) * 0.5 + 0.1
    want = [[_giou(p.tolist(), q.tolist()) for q in y] for p in x]
    assert torch.allclose(
        generalized_box_iou(x, y).double(), torch.tensor(want, dtype=torch.float64), atol=1e-6
    )
    with pytest.raises(ValueError, match=r"a must have shape \(n, 4\), got \(4,\)"):
        box_iou(torch.rand(4), y)


def _plain_cost(logits, boxes, labels, targets, w):
    """The matching cost of one query and one object, from the definition."""
    prob = logits.softmax(-1)
    return [
        [
            -w.cls * prob[q, labels[j]].item()
            + w.l1 * (boxes[q] - targets[j]).abs().sum().item()
            - w.giou * _giou(boxes[q].tolist(), targets[j].tolist())
            for j in range(len(labels))
        ]
        for q in range(len(boxes))
    ]


@pytest.mark.parametrize("seed", range(12))
def test_hungarian_matching_finds_the_cheapest_pairing_of_all(seed):
    g = torch.Generator().manual_seed(seed)
    N, K, M = 5, 3, 4
    n = seed % 5  # 0 … 4 objects, the rest padding
    logits = torch.randn(2, N, K + 1, generator=g) * 2
    boxes = torch.rand(2, N, 4, generator=g) * 0.5 + 0.1
    labels = torch.full((2, M), -1)
    labels[:, :n] = torch.randint(0, K, (2, n), generator=g)
    targets = torch.rand(2, M, 4, generator=g) * 0.5 + 0.1
    w = LossWeights(cls=1.5, l1=3.0, giou=1.0)
    for b, (q, t) in enumerate(hungarian_match(logits, boxes, labels, targets, w)):
        assert len(q) == len(t) == n and len(set(q.tolist())) == n
        cost = _plain_cost(logits[b], boxes[b], labels[b, :n], targets[b, :n], w)
        got = sum(cost[i][j] for i, j in zip(q.tolist(), t.tolist(), strict=True))
        best = min(
            (
                sum(cost[qi][j] for j, qi in enumerate(perm))
                for perm in itertools.permutations(range(N), n)
            ),
            default=0.0,
        )
        assert got == pytest.approx(best, abs=1e-5)


def test_set_loss_ignores_query_order_and_vanishes_for_a_perfect_answer():
    _, labels, boxes = make_batch(range(6))
    B, N, K = 6, 8, 3
    logits = torch.full((B, N, K + 1), -20.0)
    logits[..., K] = 20.0  # every query: no object …
    pred = torch.full((B, N, 4), 0.5)
    for b in range(B):
        for j in range(int((labels[b] >= 0).sum())):  # … but queries 2, 3, … find the objects
            logits[b, j + 2] = -20.0
            logits[b, j + 2, labels[b, j]] = 20.0
            pred[b, j + 2] = boxes[b, j]
    loss, parts = detr_loss(DETROutput(logits, pred), labels, boxes)
    assert loss.item() < 1e-6 and parts["l1"] < 1e-6 and parts["giou"] < 1e-6
    noisy = DETROutput(torch.randn(B, N, K + 1), torch.rand(B, N, 4))
    perm = torch.randperm(N)
    shuffled = DETROutput(noisy.logits[:, perm], noisy.boxes[:, perm])
    a, b = detr_loss(noisy, labels, boxes)[0], detr_loss(shuffled, labels, boxes)[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-5) and a.item() > 1.0


def test_matching_errors_name_the_shapes():
    logits, boxes = torch.randn(1, 2, 4), torch.rand(1, 2, 4)
    labels, targets = torch.tensor([[0, 1, 2]]), torch.rand(1, 3, 4)
    with pytest.raises(ValueError, match="image 0 has 3 objects but there are only 2 queries"):
        hungarian_match(logits, boxes, labels, targets)
    with pytest.raises(ValueError, match=r"labels must be \(B, M\).*got \(3,\)"):
        hungarian_match(logits, boxes, labels[0], targets)
    with pytest.raises(ValueError, match="labels hold class 5"):
        hungarian_match(logits, boxes, torch.tensor([[5]]), targets[:, :1])
    with pytest.raises(ValueError, match=r"logits must be \(B, N, K \+ 1\)"):
        hungarian_match(logits, boxes[:, :1], labels[:, :1], targets[:, :1])


def test_shapes_presets_and_config_errors():
    model = DETR(DETRConfig(**SMALL)).eval()
    out = model(torch.rand(3, 3, 64, 64))
    assert out.logits.shape == (3, 8, 4) and out.boxes.shape == (3, 8, 4)
    assert ((out.boxes > 0) & (out.boxes < 1)).all()
    assert DETRConfig.preset("small").grid == 16
    with pytest.raises(ValueError, match=r"images have 1 channels, the model 3: got \(3, 1, 64"):
        model(torch.rand(3, 1, 64, 64))
    with pytest.raises(ValueError, match="d_model=30 must be divisible by 4"):
        DETRConfig(d_model=30, n_heads=2)
    with pytest.raises(ValueError, match="image_size=60 is not divisible by 2\\^n_strides = 8"):
        DETRConfig(image_size=60)
    with pytest.raises(ValueError, match="unknown DETR preset 'huge'"):
        DETRConfig.preset("huge")


def test_cross_attention_maps_are_the_reference_weights_averaged_over_heads():
    torch.manual_seed(0)
    model = DETR(DETRConfig(**SMALL)).eval()
    seen = {}
    last = model.blocks[-1].cross_attn
    hook = last.register_forward_hook(lambda m, args, out: seen.update(x=args[0], ctx=args[1]))
    with torch.no_grad():
        out = model(torch.rand(2, 3, 64, 64), return_attention=True)
    hook.remove()
    maps = out.cross_attention
    assert maps.shape == (2, 8, 8, 8)
    assert torch.allclose(maps.sum((-2, -1)), torch.ones(2, 8), atol=1e-5)
    # softmax(q kᵀ / √D) from the layer's own projections, in fp64, per head
    H, D = last.n_heads, last.head_dim
    q = last.q_proj(seen["x"]).double().view(2, 8, H, D).transpose(1, 2)  # (B, H, N, D)
    k = last.k_proj(seen["ctx"]).double().view(2, 64, H, D).transpose(1, 2)  # (B, H, S, D)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)  # (B, H, N, S)
    assert torch.allclose(maps.double(), weights.mean(1).view(2, 8, 8, 8), atol=1e-5)


def test_save_and_load_give_the_same_detections(tmp_path):
    torch.manual_seed(1)
    model = DETR(DETRConfig(**SMALL))
    model(torch.rand(4, 3, 64, 64))  # a training-mode pass moves the batch-norm statistics
    model.eval()
    images = torch.rand(2, 3, 64, 64)
    model.save(tmp_path / "detr")
    loaded = DETR.load(tmp_path / "detr").eval()
    assert loaded.config == model.config
    with torch.no_grad():
        a, b = model(images), loaded(images)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.boxes, b.boxes)


def test_a_short_run_finds_the_shapes_far_better_than_a_blind_guess():
    # one shape per image and a small model, so that a few hundred steps suffice
    small = {**SMALL, "width": 16, "n_layers": 1, "n_queries": 2}
    spec = TaskSpec(task="shapes", model_overrides=small)
    task = ShapesTask(spec, data=ShapesConfig(max_shapes=1, min_size=14))
    # the baselines, measured on the same validation images: the untrained model, and a blind
    # guess that ignores the image (the commonest class with the mean box)
    before = task.evaluate(task.model)
    blind = task.baseline()
    config = TrainConfig(steps=300, batch_size=16, lr=6e-3, warmup=30, eval_every=0)
    Trainer(task, config).train(progress=False)
    after = task.evaluate(task.model)
    said = f"after training {after}; untrained {before}; blind guess {blind}"  # on failure
    assert blind["matching_accuracy"] < 0.05, said
    assert after["matching_accuracy"] > blind["matching_accuracy"] + 0.25, said
    assert after["matching_accuracy"] > before["matching_accuracy"] + 0.25, said
    assert after["mean_iou"] > 0.5 and after["mean_iou"] > blind["mean_iou"] + 0.2, said
    assert after["mean_iou"] > before["mean_iou"] + 0.2, said


def test_train_resume_and_detect_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "shapes"
    tiny = ["--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "4"]
    args = ["train", "--task", "shapes", "--steps", "3", "--out", str(out), "--no-progress"]
    code, text, err = run_cli([*args, *tiny, "--eval-every", "0"], capsys)
    assert code == 0, err
    assert "matching_accuracy" in text and "mean_iou" in text
    code, text, err = run_cli(["train", "--out", str(out), "--resume", "--steps", "4"], capsys)
    assert code == 0 and "resuming" in text, err
    task = build_task(TaskSpec(task="shapes", model_overrides={"d_model": 32}))
    assert type(task).__name__ == "ShapesTask"

    png = tmp_path / "shapes.png"
    code, text, err = run_cli(["detect", str(out), "--out", str(png), "--count", "2"], capsys)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    code, _, err = run_cli(["detect", str(out), "--count", "13"], capsys)
    assert code == 2 and "at most 12" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["detect", str(tmp_path / "nothing"), "--out", str(png)], capsys)
    assert code == 2 and "nothing does not exist" in err
    code, text, _ = run_cli(["detect", "--help"], capsys)
    assert code == 0 and "dikkat detect runs/shapes " in text and "detections.png" in text
