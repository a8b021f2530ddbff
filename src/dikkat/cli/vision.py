"""The vision commands of ``dikkat``: ``vit-attention``, ``vision-cost`` and ``detect``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dikkat.cli.args import add_no_verify, positive_int
from dikkat.cli.common import add_command, add_device, device_of
from dikkat.cli.folders import load_model, task_seed
from dikkat.tasks.digits import SIDE, load_digits_split
from dikkat.vision.cost import format_cost_table, vision_cost
from dikkat.vision.detr import DETR, DETROutput
from dikkat.vision.detr_plot import plot_detections
from dikkat.vision.shapes import SHAPE_NAMES, ShapesConfig, make_batch
from dikkat.vision.vit import ViT
from dikkat.vision.vit_plot import plot_attention_maps


def cmd_vit_attention(args: Any) -> int:
    """Draw a trained digits ViT's class-token attention for a few held-out digits."""

    device = device_of(args)
    model = load_model(ViT, args.run, "vit-attention", verify=not args.no_verify, device=device)
    model.eval()
    seed = args.seed
    if seed is None:  # the run's own split, so the digits shown were never trained on
        seed = task_seed(args.run)
    c = model.config
    if (c.image_size, c.channels, c.n_classes) != (SIDE, 1, 10):
        raise ValueError(
            f"{args.run} holds a ViT for {c.image_size}×{c.image_size}×{c.channels} images in "
            f"{c.n_classes} classes, not the 8×8 digits (dikkat train --task digits)"
        )
    data = load_digits_split(seed=seed)
    if args.count > len(data.test_y):
        raise ValueError(f"--count {args.count}: there are {len(data.test_y)} held-out digits")
    if args.layer is not None and not 0 <= args.layer < c.n_layers:
        raise ValueError(f"--layer {args.layer}: the model has layers 0 … {c.n_layers - 1}")
    images, labels = data.test_x[: args.count], data.test_y[: args.count]
    with torch.no_grad():
        predicted = model(images.to(device)).argmax(dim=-1).cpu()
        maps = model.attention_maps(images.to(device))
    out = args.out or Path(args.run) / "vit_attention.png"
    path = plot_attention_maps(
        images, maps, out, labels=labels, predicted=predicted, layer=args.layer
    )
    shown = "every layer" if args.layer is None else f"the heads of layer {args.layer}"
    query = "class-token" if c.pool == "cls" else "mean-query"
    print(f"{path}: {args.count} held-out digits, {query} attention of {shown}")
    return 0


def cmd_vision_cost(args: Any) -> int:
    """Print attention's cost per detector stride beside a 3×3 convolution's."""

    rows = vision_cost(args.imgsz, args.width, args.heads)
    print(format_cost_table(rows, args.imgsz))
    return 0


def cmd_detect(args: Any) -> int:
    """Draw a shapes DETR's boxes and each object query's cross-attention on validation images."""

    device = device_of(args)
    model = load_model(DETR, args.run, "detect", verify=not args.no_verify, device=device)
    model.eval()
    c, data = model.config, ShapesConfig()
    if (c.image_size, c.n_classes) != (data.image_size, len(SHAPE_NAMES)):
        raise ValueError(
            f"{args.run} holds a DETR for {c.image_size}×{c.image_size} images in "
            f"{c.n_classes} classes, not the shapes (dikkat train --task shapes)"
        )
    if args.count > 12:
        raise ValueError(f"--count {args.count}: at most 12 images fit one picture")
    if args.start < 0:
        raise ValueError(f"--start must be ≥ 0, got {args.start}")
    seed = args.seed
    if seed is None:  # the run's own validation stream: images it never trained on
        seed = task_seed(args.run)
    indices = range(args.start, args.start + args.count)
    images, labels, boxes = make_batch(indices, split="val", seed=seed, config=data)
    with torch.no_grad():
        out = model(images.to(device), return_attention=True)
    attention = None if out.cross_attention is None else out.cross_attention.cpu()
    out = DETROutput(out.logits.cpu(), out.boxes.cpu(), attention)  # drawn from the CPU
    target = args.out or Path(args.run) / "detections.png"
    path = plot_detections(images, out, target, class_names=SHAPE_NAMES, labels=labels, boxes=boxes)
    print(f"{path}: boxes and cross-attention of {args.count} validation images")
    return 0


def add_commands(sub: Any) -> None:
    """Register vit-attention, vision-cost and detect."""
    p = add_command(
        sub,
        "vit-attention",
        cmd_vit_attention,
        help="picture a digits ViT's class-token attention over the patches (PNG)",
        description="Load a ViT trained with `dikkat train --task digits`, run it on the first "
        "held-out digits of the run's own split, and draw each image beside its class token's "
        "attention over the patches: one map per layer (mean over heads), or with --layer, "
        "one per head of that layer.",
        examples=[
            ("dikkat vit-attention runs/digits", "writes runs/digits/vit_attention.png"),
            ("dikkat vit-attention runs/digits --out heads.png --layer 3 --count 4", ""),
        ],
    )
    p.add_argument("run", help="run folder of `dikkat train --task digits`")
    p.add_argument("--out", help="PNG to write (default: vit_attention.png in the run folder)")
    p.add_argument("--count", type=positive_int, default=6, help="held-out digits to show")
    p.add_argument("--layer", type=int, help="show every head of this layer (0-based)")
    p.add_argument("--seed", type=int, help="the split's seed (default: the run's)")
    add_device(p)
    add_no_verify(p)

    p = add_command(
        sub,
        "vision-cost",
        cmd_vision_cost,
        help="what attention costs at each detector stride, beside a 3×3 conv",
        description="For the stride-8, 16 and 32 feature maps of an IMGSZ image, print the "
        "tokens, score cells, FLOPs and score-matrix memory of PSA-style self-attention beside a "
        "3×3 convolution at the same width: why YOLO26 attends only at stride 32.",
        examples=[
            ("dikkat vision-cost --imgsz 640", ""),
            ("dikkat vision-cost --imgsz 1280 --width 256 --heads 4", ""),
        ],
    )
    p.add_argument("--imgsz", type=positive_int, default=640, help="image side (multiple of 32)")
    p.add_argument(
        "--width", type=positive_int, default=128, help="channels C the attention runs at"
    )
    p.add_argument("--heads", type=positive_int, help="heads (default max(C // 64, 1))")

    p = add_command(
        sub,
        "detect",
        cmd_detect,
        help="picture a shapes DETR's boxes and each object query's cross-attention (PNG)",
        description="Load a DETR trained with `dikkat train --task shapes`, run it on validation "
        "images of the run's own seed (never trained on), and draw one row per image: the image "
        "with predicted boxes, class and probability (ground truth dashed), then, for each query "
        "that predicts an object, its last-layer cross-attention over the feature grid.",
        examples=[
            ("dikkat detect runs/shapes", "writes runs/shapes/detections.png"),
            ("dikkat detect runs/shapes --out more.png --count 8 --start 100", ""),
        ],
    )
    p.add_argument("run", help="run folder of `dikkat train --task shapes`")
    p.add_argument("--out", help="PNG to write (default: detections.png in the run folder)")
    p.add_argument("--count", type=positive_int, default=4, help="images to show (at most 12)")
    p.add_argument("--start", type=int, default=0, help="first validation image index")
    p.add_argument("--seed", type=int, help="the validation stream's seed (default: the run's)")
    add_device(p)
    add_no_verify(p)
