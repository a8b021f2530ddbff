"""Coloured shapes on small images: a seeded, generated detection data set (no download).

Each image holds ``min_shapes`` … ``max_shapes`` filled squares, circles and triangles of random
size and colour on a plain dark background; shapes never overlap, so every one is fully visible.
A shape's box is the tight box of its own pixels, as normalised ``(cx, cy, w, h)`` in [0, 1].

Image ``index`` of split ``split`` under ``seed`` is drawn from its own random stream
``(seed, split, index)``: the same call gives the same image on every machine, images can be made
in any order, and the training and validation splits never share a stream.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dikkat.validate import check_sizes

SHAPE_NAMES = ("square", "circle", "triangle")  # class id = position here
SPLITS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class ShapesConfig:
    """What the generated images look like."""

    image_size: int = 64  # height = width, in pixels
    min_shapes: int = 1  # shapes per image, drawn uniformly from min … max
    max_shapes: int = 4
    min_size: int = 10  # side of a shape's bounding square, in pixels
    max_size: int = 22

    def __post_init__(self) -> None:
        check_sizes(self, "image_size", "min_shapes", "max_shapes", "min_size", "max_size")
        if not 1 <= self.min_shapes <= self.max_shapes:
            raise ValueError(
                f"need 1 ≤ min_shapes ≤ max_shapes, got {self.min_shapes} and {self.max_shapes}"
            )
        if not 4 <= self.min_size <= self.max_size <= self.image_size:
            raise ValueError(
                f"need 4 ≤ min_size ≤ max_size ≤ image_size, got {self.min_size}, "
                f"{self.max_size} and {self.image_size}"
            )

    @property
    def n_classes(self) -> int:
        return len(SHAPE_NAMES)


@dataclass
class ShapesImage:
    """One image: pixels (3, H, W) in [0, 1], class ids (n,), boxes (n, 4) as (cx, cy, w, h)."""

    image: Tensor
    labels: Tensor
    boxes: Tensor


def _shape_mask(kind: int, s: int) -> np.ndarray:
    """Boolean (s, s) mask of one shape filling an s × s square."""
    v, u = (np.mgrid[0:s, 0:s] + 0.5) / s  # pixel centres inside the square, 0 … 1
    if kind == 0:  # square
        return np.ones((s, s), dtype=bool)
    if kind == 1:  # circle inscribed in the square
        return (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    # triangle: apex at the top centre, base along the bottom edge
    return np.abs(u - 0.5) <= 0.5 * v


def _place(rng: np.random.Generator, taken: list[tuple[int, int, int]], config: ShapesConfig):
    """A square (x0, y0, s) inside the image that keeps a 1-pixel gap to every taken one."""
    for _ in range(50):
        s = int(rng.integers(config.min_size, config.max_size + 1))
        x0, y0 = (int(v) for v in rng.integers(0, config.image_size - s + 1, size=2))
        if all(
            x0 + s + 1 <= a or a + t + 1 <= x0 or y0 + s + 1 <= b or b + t + 1 <= y0
            for a, b, t in taken
        ):
            return x0, y0, s
    return None  # crowded: the image keeps fewer shapes


def make_image(
    index: int, *, split: str = "train", seed: int = 0, config: ShapesConfig | None = None
) -> ShapesImage:
    """Image ``index`` of ``split`` ('train' or 'val') under ``seed``; the same every time."""
    config = config or ShapesConfig()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    rng = np.random.default_rng([seed % 2**32, SPLITS[split], index])
    size = config.image_size
    background = rng.uniform(0.0, 0.3) + rng.uniform(-0.05, 0.05, size=3)
    image = np.broadcast_to(np.clip(background, 0, 1)[:, None, None], (3, size, size)).copy()
    labels, boxes, taken = [], [], []
    for _ in range(int(rng.integers(config.min_shapes, config.max_shapes + 1))):
        spot = _place(rng, taken, config)
        if spot is None:
            break
        taken.append(spot)
        kind = int(rng.integers(len(SHAPE_NAMES)))
        colour = colorsys.hsv_to_rgb(rng.uniform(), rng.uniform(0.5, 1.0), rng.uniform(0.7, 1.0))
        x0, y0, s = spot
        mask = np.zeros((size, size), dtype=bool)
        mask[y0 : y0 + s, x0 : x0 + s] = _shape_mask(kind, s)
        image[:, mask] = np.asarray(colour)[:, None]
        rows, cols = np.nonzero(mask)
        x_lo, x_hi, y_lo, y_hi = cols.min(), cols.max() + 1, rows.min(), rows.max() + 1
        box = ((x_lo + x_hi) / 2, (y_lo + y_hi) / 2, x_hi - x_lo, y_hi - y_lo)
        boxes.append([float(c) / size for c in box])
        labels.append(kind)
    return ShapesImage(
        torch.from_numpy(image).float(),
        torch.tensor(labels, dtype=torch.long),
        torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
    )


def make_batch(
    indices: list[int] | Tensor,
    *,
    split: str = "train",
    seed: int = 0,
    config: ShapesConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Images (B, 3, H, W), labels (B, M) and boxes (B, M, 4), M = ``max_shapes``.

    Rows with fewer shapes are padded with label −1 and box 0.
    """
    config = config or ShapesConfig()
    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("indices must name at least one image")
    M, size = config.max_shapes, config.image_size
    images = torch.empty(len(indices), 3, size, size)
    labels = torch.full((len(indices), M), -1, dtype=torch.long)
    boxes = torch.zeros(len(indices), M, 4)
    for row, i in enumerate(indices):
        item = make_image(i, split=split, seed=seed, config=config)
        n = len(item.labels)
        images[row], labels[row, :n], boxes[row, :n] = item.image, item.labels, item.boxes
    return images, labels, boxes
