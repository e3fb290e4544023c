"""Dense prediction: pyramid models as backbones, Semantic FPN segmentation."""

from lgvit.dense.backbone import DenseBackbone, create_backbone, dense_backbone_names, is_pyramid

__all__ = ["DenseBackbone", "create_backbone", "dense_backbone_names", "is_pyramid"]
