"""Dense prediction: pyramid models as backbones, Semantic FPN segmentation, RetinaNet and
Mask R-CNN (torchvision's) on them."""

from lgvit.dense.backbone import DenseBackbone, create_backbone, dense_backbone_names, is_pyramid

__all__ = ["DenseBackbone", "create_backbone", "dense_backbone_names", "is_pyramid"]
