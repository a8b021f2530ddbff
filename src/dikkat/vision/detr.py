"""DETR-style detection: learned object queries cross-attend to image features (docs/contract.md
§14).

Notation: ``B`` batch, ``N`` object queries, ``C`` model width, ``h``/``w`` the feature grid,
``S = h·w`` feature tokens, ``K`` object classes (class ``K`` is "no object"), ``M`` padded
ground-truth objects per image.

images (B, 3, H, W) → strided ``Conv``s and a ``C2PSA`` → features (B, C, h, w) → tokens
(B, S, C) + 2-D sinusoidal positions → decoder blocks: the N queries attend to each other
(self-attention) and to the S tokens (cross-attention) → per query a class (K + 1 logits) and a
box (sigmoid → normalised cx, cy, w, h).

There is no ordering between queries and objects: training first pairs them one-to-one by the
Hungarian algorithm on a matching cost (:func:`hungarian_match`), then scores each query against
its partner, and the unpaired queries against "no object" (:func:`detr_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dikkat.layers.block import Block, BlockConfig
from dikkat.layers.inputs import check_images, check_meets
from dikkat.layers.linear import Linear
from dikkat.layers.norm import LayerNorm
from dikkat.layers.positional import sinusoidal_table
from dikkat.models.io import SaveLoad
from dikkat.presets import pick_preset
from dikkat.validate import check_sizes
from dikkat.vision.psa import C2PSA, Conv

__all__ = [
    "DETR",
    "DETR_PRESETS",
    "DETRConfig",
    "DETROutput",
    "LossWeights",
    "box_cxcywh_to_xyxy",
    "box_iou",
    "detection_metrics",
    "detr_loss",
    "generalized_box_iou",
    "hungarian_match",
    "match_cost",
]


@dataclass(frozen=True)
class DETRConfig:
    """Sizes of a small DETR."""

    image_size: int = 64  # input height = width, in pixels
    n_classes: int = 3  # K object classes (the model adds "no object")
    n_queries: int = 8  # N object queries: the most objects one image can yield
    width: int = 32  # channels of the first convolution; each later stride doubles them
    n_strides: int = 3  # stride-2 convolutions: the feature grid is image_size / 2^n_strides
    d_model: int = 64  # C: feature channels and decoder width
    psa_blocks: int = 1  # PSABlocks inside the encoder's C2PSA
    n_layers: int = 3  # decoder blocks
    n_heads: int = 4  # decoder attention heads
    d_ff: int | None = None  # decoder MLP width; None = 4·d_model
    dropout: float = 0.0  # decoder dropout

    def __post_init__(self) -> None:
        check_sizes(
            self, "image_size", "n_classes", "n_queries", "width", "n_strides", "psa_blocks",
            "n_layers",
        )  # fmt: skip
        self.block()  # validates d_model, heads, d_ff and dropout
        if self.image_size % 2**self.n_strides:
            raise ValueError(
                f"image_size={self.image_size} is not divisible by 2^n_strides = "
                f"{2**self.n_strides}"
            )
        if self.d_model % 4:
            raise ValueError(f"d_model={self.d_model} must be divisible by 4 (2-D sin/cos)")
        # the encoder's C2PSA attends over half the channels with one head per 64 of them
        psa, heads = self.d_model // 2, max(self.d_model // 2 // 64, 1)
        if psa % heads:
            raise ValueError(
                f"d_model={self.d_model}: the encoder's C2PSA splits its {psa} attention channels "
                f"into {heads} heads, which does not divide them"
            )

    @property
    def grid(self) -> int:
        """Side of the feature grid."""
        return self.image_size // 2**self.n_strides

    def block(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            norm="pre",
            activation="gelu",
            dropout=self.dropout,
            cross_attention=True,
        )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> DETRConfig:
        """A named configuration, optionally with some fields changed."""
        return pick_preset(DETR_PRESETS, name, "DETR", overrides)


DETR_PRESETS: dict[str, DETRConfig] = {
    # The shapes task on a CPU: an 8 × 8 feature grid, 3 decoder blocks of width 64.
    "tiny": DETRConfig(),
    # Twice the width, a 16 × 16 grid and more blocks: finer boxes, several times the compute.
    "small": DETRConfig(width=32, n_strides=2, d_model=128, n_layers=4, n_heads=8),
}


def sinusoidal_2d(h: int, w: int, d_model: int) -> Tensor:
    """(h·w, C) positions of a row-major grid: sin/cos of the row in the first C/2 channels, of
    the column in the last C/2 (the 1-D table of :mod:`dikkat.layers.positional` per axis)."""
    rows = sinusoidal_table(h, d_model // 2)  # (h, C/2)
    cols = sinusoidal_table(w, d_model // 2)  # (w, C/2)
    grid = torch.cat(
        (rows[:, None].expand(h, w, -1), cols[None, :].expand(h, w, -1)), dim=-1
    )  # (h, w, C)
    return grid.reshape(h * w, d_model)


@dataclass
class DETROutput:
    """Per query: class logits (B, N, K + 1), boxes (B, N, 4) as (cx, cy, w, h) in [0, 1]; and,
    when asked, the last decoder block's cross-attention averaged over heads (B, N, h, w)."""

    logits: Tensor
    boxes: Tensor
    cross_attention: Tensor | None = None


class DETR(SaveLoad, nn.Module):
    """Convolutional + PSA encoder, object-query decoder, class and box heads.

    >>> model = DETR(DETRConfig())
    >>> out = model(torch.rand(2, 3, 64, 64), return_attention=True)
    >>> out.logits.shape, out.boxes.shape, out.cross_attention.shape
    (torch.Size([2, 8, 4]), torch.Size([2, 8, 4]), torch.Size([2, 8, 8, 8]))
    """

    config_class = DETRConfig

    def __init__(self, config: DETRConfig, *, backend: str = "auto") -> None:
        super().__init__()
        self.config = c = config
        widths = [3] + [c.width * 2**i for i in range(c.n_strides - 1)] + [c.d_model]
        convs = [Conv(a, b, 3, 2) for a, b in pairwise(widths)]
        self.encoder = nn.Sequential(
            *convs, C2PSA(c.d_model, c.d_model, n=c.psa_blocks, backend=backend)
        )
        self.feature_norm = LayerNorm(c.d_model)
        self.register_buffer("pos", sinusoidal_2d(c.grid, c.grid, c.d_model), persistent=False)
        self.queries = nn.Parameter(torch.randn(c.n_queries, c.d_model))
        self.blocks = nn.ModuleList(Block(c.block(), backend=backend) for _ in range(c.n_layers))
        self.norm = LayerNorm(c.d_model)
        self.class_head = Linear(c.d_model, c.n_classes + 1)
        self.box_head = nn.Sequential(
            Linear(c.d_model, c.d_model),
            nn.ReLU(),
            Linear(c.d_model, c.d_model),
            nn.ReLU(),
            Linear(c.d_model, 4),
        )

    def encode(self, images: Tensor) -> Tensor:
        """images (B, 3, H, W) → feature tokens with positions (B, S, C)."""
        check_images(images, 3, self.config.image_size)
        check_meets("images", images, self.encoder[0].conv.weight, "DETR")
        f = self.encoder(images)  # (B, C, h, w)
        tokens = f.flatten(2).transpose(1, 2)  # (B, S, C), row-major over the grid
        return self.feature_norm(tokens) + self.pos

    def forward(self, images: Tensor, *, return_attention: bool = False) -> DETROutput:
        """images (B, 3, H, W) in [0, 1] → a :class:`DETROutput`.

        ``return_attention``: also the last block's cross-attention weights, averaged over heads;
        each query's map sums to 1 over the feature grid.
        """
        memory = self.encode(images)
        B = memory.shape[0]
        x = self.queries.expand(B, -1, -1)  # (B, N, C)
        weights = None
        for i, block in enumerate(self.blocks):
            if return_attention and i == len(self.blocks) - 1:
                x, bw = block(x, context=memory, return_weights=True)
                g = self.config.grid
                weights = bw.cross_attn.mean(1).view(B, -1, g, g)  # (B, H, N, S) → (B, N, h, w)
            else:
                x = block(x, context=memory)
        x = self.norm(x)
        return DETROutput(self.class_head(x), self.box_head(x).sigmoid(), weights)


# --- boxes ----------------------------------------------------------------------------------------


def box_cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """(…, 4) centre and size → corners (x0, y0, x1, y1)."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), dim=-1)


def _area(corners: Tensor) -> Tensor:
    return (corners[..., 2:] - corners[..., :2]).clamp(min=0).prod(-1)


def _pairwise(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(n, 4) and (m, 4) cxcywh boxes → intersection, union and enclosing-box areas (n, m)."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.shape[-1] != 4:
            raise ValueError(f"{name} must have shape (n, 4), got {tuple(t.shape)}")
    a, b = box_cxcywh_to_xyxy(a)[:, None], box_cxcywh_to_xyxy(b)[None]  # (n, 1, 4), (1, m, 4)
    lo, hi = torch.maximum(a[..., :2], b[..., :2]), torch.minimum(a[..., 2:], b[..., 2:])
    inter = (hi - lo).clamp(min=0).prod(-1)
    union = _area(a) + _area(b) - inter
    lo, hi = torch.minimum(a[..., :2], b[..., :2]), torch.maximum(a[..., 2:], b[..., 2:])
    return inter, union, (hi - lo).prod(-1)


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """Intersection over union of every pair of (n, 4) and (m, 4) cxcywh boxes → (n, m)."""
    inter, union, _ = _pairwise(a, b)
    return inter / union.clamp(min=1e-9)


def generalized_box_iou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU = IoU − (enclosing − union) / enclosing, in [−1, 1], for every pair → (n, m)."""
    inter, union, enclosing = _pairwise(a, b)
    iou = inter / union.clamp(min=1e-9)
    return iou - (enclosing - union) / enclosing.clamp(min=1e-9)


# --- matching and loss ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LossWeights:
    """Weights of the matching cost and of the loss (the same three terms in both)."""

    cls: float = 1.0  # matching: −p(class); loss: cross-entropy
    l1: float = 5.0  # L1 distance between (cx, cy, w, h) boxes
    giou: float = 2.0  # matching: −GIoU; loss: 1 − GIoU
    no_object: float = 0.1  # cross-entropy weight of the "no object" class


def _check_targets(logits: Tensor, boxes: Tensor, labels: Tensor, target_boxes: Tensor) -> None:
    if logits.dim() != 3 or tuple(boxes.shape) != (*logits.shape[:2], 4):
        raise ValueError(
            f"logits must be (B, N, K + 1) and boxes (B, N, 4), got {tuple(logits.shape)} and "
            f"{tuple(boxes.shape)}"
        )
    B = logits.shape[0]
    fits = labels.dim() == 2 and labels.shape[0] == B
    if not fits or tuple(target_boxes.shape) != (*labels.shape, 4):
        raise ValueError(
            f"labels must be (B, M) and target_boxes (B, M, 4) with B = {B}, got "
            f"{tuple(labels.shape)} and {tuple(target_boxes.shape)}"
        )
    real = labels[labels >= 0]
    if real.numel() and int(real.max()) >= logits.shape[-1] - 1:
        raise ValueError(
            f"labels hold class {int(real.max())}, but logits {tuple(logits.shape)} have only "
            f"{logits.shape[-1] - 1} object classes"
        )


def match_cost(
    logits: Tensor, boxes: Tensor, labels: Tensor, target_boxes: Tensor, weights: LossWeights
) -> Tensor:
    """Cost (N, n) of pairing each of one image's N queries with each of its n objects.

    logits (N, K + 1), boxes (N, 4), labels (n,), target_boxes (n, 4).
    """
    prob = logits.float().softmax(-1)[:, labels]  # (N, n): p(the object's class)
    l1 = torch.cdist(boxes.float(), target_boxes.float(), p=1)
    giou = generalized_box_iou(boxes.float(), target_boxes.float())
    return weights.cls * -prob + weights.l1 * l1 + weights.giou * -giou


@torch.no_grad()
def hungarian_match(
    logits: Tensor,
    boxes: Tensor,
    labels: Tensor,
    target_boxes: Tensor,
    weights: LossWeights | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """Per image, the one-to-one pairing of queries and objects of least total cost.

    Args:
        logits: (B, N, K + 1); boxes: (B, N, 4).
        labels: (B, M) class ids, −1 = padding; target_boxes: (B, M, 4).

    Returns:
        Per image, (query indices, object indices), both of length n = its number of objects
        (objects are indexed among the non-padding entries, in order). Needs N ≥ n.
    """
    # scipy.optimize takes about half a second to import: loaded by the first match, not by
    # `import dikkat.vision` (which `dikkat --help` reaches through the task registry)
    from scipy.optimize import linear_sum_assignment

    _check_targets(logits, boxes, labels, target_boxes)
    weights = weights or LossWeights()
    out = []
    for b in range(logits.shape[0]):
        real = labels[b] >= 0
        n = int(real.sum())
        if n > logits.shape[1]:
            raise ValueError(
                f"image {b} has {n} objects but there are only {logits.shape[1]} queries"
            )
        cost = match_cost(logits[b], boxes[b], labels[b][real], target_boxes[b][real], weights)
        rows, cols = linear_sum_assignment(cost.cpu().numpy())
        out.append(
            (torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long))
        )
    return out


def detr_loss(
    out: DETROutput, labels: Tensor, target_boxes: Tensor, weights: LossWeights | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Set loss after Hungarian matching: weighted cross-entropy over all queries (unmatched ones
    target "no object") + L1 and 1 − GIoU over matched boxes, each averaged over the objects.

    Returns the loss and its parts (as floats, for logging).
    """
    weights = weights or LossWeights()
    logits, boxes = out.logits, out.boxes
    matches = hungarian_match(logits, boxes, labels, target_boxes, weights)
    B, N, K1 = logits.shape
    target_classes = torch.full((B, N), K1 - 1, dtype=torch.long, device=logits.device)
    pred, true = [], []
    for b, (q, t) in enumerate(matches):
        real_labels, real_boxes = labels[b][labels[b] >= 0], target_boxes[b][labels[b] >= 0]
        target_classes[b, q] = real_labels[t]
        pred.append(boxes[b, q])
        true.append(real_boxes[t])
    class_weight = torch.ones(K1, device=logits.device)
    class_weight[-1] = weights.no_object
    ce = F.cross_entropy(logits.flatten(0, 1).float(), target_classes.flatten(), class_weight)
    pred_boxes, true_boxes = torch.cat(pred).float(), torch.cat(true).float()
    n = max(len(true_boxes), 1)
    l1 = (pred_boxes - true_boxes).abs().sum() / n
    giou = (1 - torch.diagonal(generalized_box_iou(pred_boxes, true_boxes))).sum() / n
    loss = weights.cls * ce + weights.l1 * l1 + weights.giou * giou
    return loss, {"ce": ce.item(), "l1": l1.item(), "giou": giou.item()}


@torch.no_grad()
def detection_metrics(
    logits: Tensor,
    boxes: Tensor,
    labels: Tensor,
    target_boxes: Tensor,
    *,
    iou_threshold: float = 0.5,
    weights: LossWeights | None = None,
) -> dict[str, float]:
    """How well predictions (B, N, …) find the objects (B, M, …), after Hungarian matching.

    - ``matching_accuracy``: the fraction of objects whose matched query's most likely class
      (over all K + 1) is the object's class and whose box has IoU ≥ ``iou_threshold`` with it;
    - ``mean_iou``: the IoU of each object with its matched query's box, averaged over objects;
    - ``precision``: of the queries predicting an object (most likely class ≠ no object), the
      fraction that are such a correct match.
    """
    matches = hungarian_match(logits, boxes, labels, target_boxes, weights)
    predicted = logits.argmax(-1)  # (B, N)
    hits = objects = 0
    iou_sum = 0.0
    for b, (q, t) in enumerate(matches):
        real = labels[b] >= 0
        iou = torch.diagonal(box_iou(boxes[b, q].float(), target_boxes[b][real][t].float()))
        right = (predicted[b, q] == labels[b][real][t]) & (iou >= iou_threshold)
        hits += int(right.sum())
        objects += len(t)
        iou_sum += float(iou.sum())
    claimed = int((predicted != logits.shape[-1] - 1).sum())
    return {
        "matching_accuracy": hits / max(objects, 1),
        "mean_iou": iou_sum / max(objects, 1),
        "precision": hits / max(claimed, 1),
    }
