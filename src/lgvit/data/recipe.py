"""The DeiT augmentation recipe: its defaults and the names its choices take.

One home, read by the loader's ``AugmentConfig`` and by the run's ``TrainConfig`` (the data
layer does not import the run's config). Plain values only, so the command line's config
(``lgvit --help``) can read them without importing torch's transforms.
"""

from __future__ import annotations

from typing import Any

TRAIN_CROPS = ("random_crop", "random_resized_crop", "none")
RE_MODES = ("pixel", "rand", "const")  # random erasing fill, as in timm

# The DeiT recipe at CIFAR resolution (TrainConfig says what each key means).
DEIT_RECIPE: dict[str, Any] = {
    "train_crop": "random_crop",
    "crop_padding": 4,
    "hflip": True,
    "alternate_flip": False,
    "rand_augment": "rand-m9-mstd0.5-inc1",
    "mixup": 0.8,
    "cutmix": 1.0,
    "mixup_switch_prob": 0.5,
    "mixup_prob": 1.0,
    "label_smoothing": 0.1,
    "reprob": 0.25,
    "remode": "pixel",
}
