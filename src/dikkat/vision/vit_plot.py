"""Pictures of where a ViT looks: the pooled query's attention over the patches, by each image."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from dikkat.vision.vit import AttentionMaps


def plot_attention_maps(
    images: Tensor,
    maps: AttentionMaps,
    path: str | Path,
    *,
    labels: Tensor | None = None,
    predicted: Tensor | None = None,
    layer: int | None = None,
) -> Path:
    """One row per image: the image, then one attention map per layer (mean over heads), or,
    with ``layer``, one per head of that layer. Written as a PNG (atomically) to ``path``.

    Args:
        images: (B, Ch, side, side), the images ``maps`` was computed on (the first channel is
            drawn, in grey).
        maps: from :meth:`ViT.attention_maps`.
        labels, predicted: (B,) class indices to write above each row's image.
        layer: show this layer's heads instead of every layer.
    """
    import matplotlib  # lazily: slow to import, and only pictures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dikkat.viz.figure import save_png

    grids = maps.patches().detach().float().cpu()  # (L, B, H, g, g)
    L, B, H = grids.shape[:3]
    if images.shape[0] != B:
        raise ValueError(f"images hold {images.shape[0]} images, the maps {B}")
    if layer is not None and not 0 <= layer < L:
        raise ValueError(f"layer {layer} does not exist: the model has layers 0 … {L - 1}")
    if layer is None:
        panels = [(f"layer {i}", grids[i].mean(dim=1)) for i in range(L)]  # (B, g, g) each
    else:
        panels = [(f"layer {layer}, head {h}", grids[layer, :, h]) for h in range(H)]
    cols = 1 + len(panels)
    fig, axes = plt.subplots(B, cols, figsize=(1.6 * cols, 1.7 * B), dpi=110, squeeze=False)
    side = images.shape[-1]
    for b in range(B):
        ax = axes[b, 0]
        ax.imshow(
            images[b, 0].detach().float().cpu().numpy(), cmap="gray_r", interpolation="nearest"
        )
        caption = []
        if labels is not None:
            caption.append(f"label {int(labels[b])}")
        if predicted is not None:
            caption.append(f"predicted {int(predicted[b])}")
        ax.set_title(", ".join(caption), fontsize=7)
        for c, (title, grid) in enumerate(panels, start=1):
            ax = axes[b, c]
            # each patch's weight painted over its pixels, so the map lines up with the image
            ax.imshow(
                grid[b].numpy(), cmap="magma", interpolation="nearest", extent=(0, side, side, 0)
            )
            if b == 0:
                ax.set_title(title, fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    pooled = "the class token's" if maps.has_cls else "the mean query's"
    fig.suptitle(f"{pooled} attention over the patches (each map on its own scale)", fontsize=9)
    fig.tight_layout()
    return save_png(fig, path)
