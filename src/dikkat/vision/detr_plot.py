"""Pictures of a DETR at work: predicted boxes, and where each object query looked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from dikkat.vision.detr import DETROutput, box_cxcywh_to_xyxy


def active_queries(output: DETROutput, image: int) -> list[tuple[int, int, float]]:
    """(query, class, probability) of each query of one image whose most likely class is an
    object, left to right by box centre."""
    probs = output.logits[image].float().softmax(-1)  # (N, K + 1)
    p, cls = probs.max(-1)
    no_object = probs.shape[-1] - 1
    found = [(q, int(cls[q]), float(p[q])) for q in range(len(cls)) if int(cls[q]) != no_object]
    return sorted(found, key=lambda f: float(output.boxes[image, f[0], 0]))


def plot_detections(
    images: Tensor,
    output: DETROutput,
    path: str | Path,
    *,
    class_names: Sequence[str],
    labels: Tensor | None = None,
    boxes: Tensor | None = None,
) -> Path:
    """One row per image: the image with its predicted boxes (ground truth dashed, if given),
    then each active query's cross-attention over the feature grid, drawn over the image.

    images (B, 3, H, W) in [0, 1]; ``output`` from ``model(images, return_attention=True)``;
    labels (B, M) and boxes (B, M, 4), −1 = padding, optional.
    """
    import matplotlib  # lazily: slow to import, and only pictures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from dikkat.viz.figure import save_png

    if output.cross_attention is None:
        raise ValueError("output has no cross-attention: call the model with return_attention")
    B, _, H, W = images.shape
    found = [active_queries(output, b) for b in range(B)]
    cols = 1 + max(1, max(len(f) for f in found))
    colours = plt.get_cmap("tab10")

    def draw_box(ax, box: Tensor, colour, style: str = "-") -> None:
        x0, y0, x1, y1 = (box_cxcywh_to_xyxy(box.float()) * H).tolist()
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec=colour, lw=1.5, ls=style))

    fig, axes = plt.subplots(B, cols, figsize=(1.9 * cols, 2.0 * B), dpi=110, squeeze=False)
    for b in range(B):
        picture = images[b].permute(1, 2, 0).clamp(0, 1).cpu().numpy()
        ax = axes[b, 0]
        ax.imshow(picture, extent=(0, W, H, 0))
        if labels is not None and boxes is not None:
            for j in range(labels.shape[1]):
                if int(labels[b, j]) >= 0:
                    draw_box(ax, boxes[b, j], "white", "--")
        for i, (q, cls, p) in enumerate(found[b]):
            draw_box(ax, output.boxes[b, q], colours(i % 10))
            x0, y0 = (box_cxcywh_to_xyxy(output.boxes[b, q].float())[:2] * H).tolist()
            ax.text(x0, y0 - 1, f"{class_names[cls]} {p:.2f}", color=colours(i % 10), fontsize=6)
        ax.set_title("prediction" + (" (truth dashed)" if labels is not None else ""), fontsize=7)
        for i, (q, cls, _) in enumerate(found[b]):
            ax = axes[b, 1 + i]
            ax.imshow(picture * 0.35, extent=(0, W, H, 0))
            attn = output.cross_attention[b, q].float().cpu().numpy()
            ax.imshow(attn, cmap="magma", alpha=0.75, extent=(0, W, H, 0), interpolation="nearest")
            draw_box(ax, output.boxes[b, q], colours(i % 10))
            ax.set_title(f"query {q}: {class_names[cls]}", fontsize=7, color=colours(i % 10))
        for ax in axes[b]:
            ax.set_xticks([])
            ax.set_yticks([])
            if not ax.images:
                ax.axis("off")
            else:
                ax.set_xlim(0, W)
                ax.set_ylim(H, 0)
    fig.suptitle("object queries: boxes, and each query's cross-attention (last layer)", fontsize=9)
    fig.tight_layout()
    return save_png(fig, path)
