"""A ViT's class token over the patches, and how much each patch matters to the prediction.

Notation: ``Ch`` channels, ``N`` patches on a g × g grid, ``T`` = N + 1 tokens (the class
token first).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dikkat.maps.collect import Selection, collect, layer_family
from dikkat.maps.faithfulness import Faithfulness, gradient_x_input
from dikkat.maps.rollout import rollout
from dikkat.vision.vit import ViT
from dikkat.viz.maps import AttentionMaps

__all__ = ["CLASS_TOKEN", "image_faithfulness", "patch_labels", "vit_maps"]

CLASS_TOKEN = "[CLS]"


def patch_labels(grid: int) -> tuple[str, ...]:
    """``"(row,col)"`` per patch of a ``grid`` × ``grid`` image, in row-major order."""
    return tuple(f"({r},{c})" for r in range(grid) for c in range(grid))


def _image(model: ViT, image: Tensor) -> Tensor:
    c = model.config
    if not isinstance(image, Tensor):
        raise TypeError(f"image must be a tensor (Ch, side, side), got {type(image).__name__}")
    x = image[None] if image.dim() == 3 else image
    if tuple(x.shape) != (1, c.channels, c.image_size, c.image_size):
        raise ValueError(
            f"image must be ({c.channels}, {c.image_size}, {c.image_size}) for this ViT, got "
            f"{tuple(image.shape)}"
        )
    return x.to(model.patch_embed.weight.device, model.patch_embed.weight.dtype)


def vit_maps(
    model: ViT,
    image: Tensor,
    *,
    layers: Selection = None,
    heads: Selection = None,
    rows: Selection = 0,
    title: str = "",
) -> AttentionMaps:
    """Kind ``"image"``: the class token's row (``rows=0``; None keeps every token's, which
    rollout needs) over the class token and the patches."""
    if model.cls_token is None:
        raise ValueError("this ViT pools the mean of its tokens and has no class token to follow")
    x = _image(model, image)
    labels = (CLASS_TOKEN, *patch_labels(model.config.grid))
    was = model.training
    model.eval()
    try:
        return collect(
            model,
            lambda: model(x),
            family=layer_family(model),
            queries=labels,
            keys=labels,
            layers=layers,
            heads=heads,
            rows=rows,
            kind="image",
            title=title,
        )
    finally:
        model.train(was)


def image_faithfulness(model: ViT, image: Tensor) -> Faithfulness:
    """The class token's attention on each patch (each layer's mean over heads, and the
    rollout) against that patch's importance to the log-probability of the predicted class:
    leave-one-out (the patch's P × P pixels set to 0) and gradient × input on the patch
    embeddings."""
    c = model.config
    x = _image(model, image)
    full = vit_maps(model, image, rows=None)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            logp = model(x)[0].double().log_softmax(-1)
            predicted = int(logp.argmax())
            occluded = []
            P = c.patch_size
            for j in range(c.n_patches):
                r, col = divmod(j, c.grid)
                y = x.clone()
                y[..., r * P : (r + 1) * P, col * P : (col + 1) * P] = 0
                occluded.append(y[0])
            lp = model(torch.stack(occluded)).double().log_softmax(-1)[:, predicted]
            loo = (logp[predicted] - lp).abs().cpu().numpy()
        grad = gradient_x_input(model.patch_embed, lambda: model(x)[0].log_softmax(-1)[predicted])
    finally:
        model.train(was)
    patches = list(range(1, c.n_tokens))
    attention = {
        f"{layer} (mean of heads)": full.weights[i, :, 0][:, patches]
        .mean(axis=0)
        .astype(np.float64)
        for i, layer in enumerate(full.layers)
    }
    attention[f"rollout to {full.layers[-1]}"] = rollout(full.weights)[-1, 0, patches]
    return Faithfulness(
        focus=CLASS_TOKEN,
        position=0,
        output=f"|Δ log p(class {predicted})| when the patch is blacked out; gradient × input",
        tokens=patch_labels(c.grid),
        positions=tuple(patches),
        importance={"leave-one-out": loo, "gradient × input": grad},
        attention=attention,
    )
