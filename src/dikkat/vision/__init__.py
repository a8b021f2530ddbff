"""Attention on images: ViT, the YOLO-style PSA blocks, and DETR-style object queries."""
