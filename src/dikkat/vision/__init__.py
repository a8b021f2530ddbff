"""Attention on images: ViT, the YOLO-style PSA blocks, and DETR-style object queries."""

from dikkat.vision.detr import (
    DETR,
    DETRConfig,
    DETROutput,
    LossWeights,
    box_iou,
    detection_metrics,
    detr_loss,
    generalized_box_iou,
    hungarian_match,
)
from dikkat.vision.psa import C2PSA, Attention, Bottleneck, C3k2, Conv, PSABlock
from dikkat.vision.shapes import SHAPE_NAMES, ShapesConfig, ShapesImage, make_batch, make_image
from dikkat.vision.vit import ViT, ViTConfig

__all__ = [
    "C2PSA",
    "DETR",
    "SHAPE_NAMES",
    "Attention",
    "Bottleneck",
    "C3k2",
    "Conv",
    "DETRConfig",
    "DETROutput",
    "LossWeights",
    "PSABlock",
    "ShapesConfig",
    "ShapesImage",
    "ViT",
    "ViTConfig",
    "box_iou",
    "detection_metrics",
    "detr_loss",
    "generalized_box_iou",
    "hungarian_match",
    "make_batch",
    "make_image",
]
