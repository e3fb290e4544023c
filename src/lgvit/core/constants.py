"""Constants shared across lgvit, each defined once: normalisation statistics, the eval crop
fraction, the data loaders' defaults and the image file suffixes lgvit reads."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2471, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

# Eval: resize to size / CROP_PCT, then centre-crop size (the DeiT/timm default).
CROP_PCT = 0.875

# The data loaders' defaults, for every task and source (config keys ``workers`` and
# ``max_bad_fraction``, eval's ``-j``): DataLoader processes decoding a split read while
# iterating, and the share of unreadable images a split (or a pass) tolerates before stopping.
DECODE_WORKERS = 2
MAX_BAD_FRACTION = 0.05

# The largest side of det_scale / seg_scale (config and dense checkpoints): twice the largest a
# recipe here reaches (mmseg's 2048 at ratio 2.0). The size probe runs at 64 px: [100000,
# 100000] passed it, then asked for 96 GB.
MAX_DENSE_SCALE = 8192

# The most classes a dataset's labels may imply (the largest label + 1, or a declared count):
# 4.6x ImageNet-21k's 21,843, the largest public label set these models are trained on. One
# stray label (``cls`` 999999999 in a shard) would otherwise size the head, its gradients and
# AdamW's states from a few bytes of input: at 100,000 classes and width 768 they total 1.2 GB.
MAX_CLASSES = 100_000

IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".gif",
    ".tif",
    ".tiff",
    ".webp",
    ".ppm",
    ".pgm",
)
