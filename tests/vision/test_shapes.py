"""The generated shapes data set: seeded, boxes that fit the pixels, classes that fit the shapes."""

import math

import pytest
import torch

from dikkat.vision.shapes import SHAPE_NAMES, ShapesConfig, make_batch, make_image


def _background(image: torch.Tensor) -> torch.Tensor:
    """The commonest colour: shapes cover less than half of any image."""
    colours, counts = image.flatten(1).T.unique(dim=0, return_counts=True)
    return colours[counts.argmax()]


def _pixel_box(box: torch.Tensor, size: int) -> tuple[int, int, int, int]:
    cx, cy, w, h = (box * size).tolist()
    return round(cx - w / 2), round(cy - h / 2), round(cx + w / 2), round(cy + h / 2)


def test_the_same_index_gives_the_same_image_in_any_order():
    a = make_image(7, seed=3)
    b = make_image(7, seed=3)
    assert torch.equal(a.image, b.image) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.boxes, b.boxes)
    images, labels, boxes = make_batch([9, 7], seed=3)
    assert torch.equal(images[1], a.image)
    n = len(a.labels)
    assert torch.equal(labels[1, :n], a.labels) and (labels[1, n:] == -1).all()
    assert torch.equal(boxes[1, :n], a.boxes)
    assert not torch.equal(make_image(7, seed=4).image, a.image)
    assert not torch.equal(make_image(8, seed=3).image, a.image)


def test_training_and_validation_images_differ():
    train = {make_image(i, split="train").image.numpy().tobytes() for i in range(150)}
    val = {make_image(i, split="val").image.numpy().tobytes() for i in range(150)}
    assert len(train) == len(val) == 150
    assert not train & val


def test_each_box_is_the_tight_box_of_its_shape_and_nothing_else_is_drawn():
    config = ShapesConfig()
    size = config.image_size
    for i in range(60):
        item = make_image(i, config=config)
        image = item.image
        drawn = (image != _background(image)[:, None, None]).any(0)  # (H, W)
        explained = torch.zeros_like(drawn)
        for box in item.boxes:
            x0, y0, x1, y1 = _pixel_box(box, size)
            colour = image[:, (y0 + y1) // 2, (x0 + x1) // 2]  # a box's centre lies in its shape
            own = (image == colour[:, None, None]).all(0)
            inside = torch.zeros_like(own)
            inside[y0:y1, x0:x1] = True
            assert not (own & ~inside).any(), f"image {i}: shape pixels outside box {box}"
            mine = own & inside
            # tight: the shape reaches every edge of its box
            assert mine[y0].any() and mine[y1 - 1].any()
            assert mine[:, x0].any() and mine[:, x1 - 1].any()
            explained |= mine
        assert torch.equal(drawn, explained), f"image {i}: pixels outside every box"


def test_classes_match_the_shapes_they_name():
    fill = {name: [] for name in SHAPE_NAMES}
    counts = []
    for i in range(200):
        item = make_image(i)
        counts.append(len(item.labels))
        for label, box in zip(item.labels, item.boxes, strict=True):
            x0, y0, x1, y1 = _pixel_box(box, 64)
            colour = item.image[:, (y0 + y1) // 2, (x0 + x1) // 2]
            own = (item.image[:, y0:y1, x0:x1] == colour[:, None, None]).all(0)
            fill[SHAPE_NAMES[label]].append(own.float().mean().item())
            # sizes 10 … 22; an even-sized triangle's apex falls between pixel centres (−1 row)
            assert 10 <= x1 - x0 <= 22 and 9 <= y1 - y0 <= 22
    assert min(counts) == 1 and max(counts) == 4
    mean = {k: sum(v) / len(v) for k, v in fill.items()}
    assert all(len(v) > 50 for v in fill.values())  # every class is common
    assert mean["square"] == 1.0  # a square fills its box
    assert abs(mean["circle"] - math.pi / 4) < 0.05  # a disc fills π/4 of it
    assert abs(mean["triangle"] - 0.5) < 0.06  # a triangle about half


def test_padding_of_a_batch():
    images, labels, boxes = make_batch(range(5), config=ShapesConfig(max_shapes=3))
    assert images.shape == (5, 3, 64, 64) and labels.shape == (5, 3) and boxes.shape == (5, 3, 4)
    assert ((labels == -1) == (boxes == 0).all(-1)).all()
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_image(0, split="test"), "split must be one of"),
        (lambda: make_image(-1), "index must be a non-negative int"),
        (lambda: make_batch([]), "indices must name at least one image"),
        (lambda: ShapesConfig(min_shapes=3, max_shapes=2), "min_shapes ≤ max_shapes"),
        (lambda: ShapesConfig(max_size=80), "max_size ≤ image_size"),
    ],
)
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
