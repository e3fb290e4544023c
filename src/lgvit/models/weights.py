"""The authors' released weights, by name: one entry per released file, as a timm tag.

``create_model("lit_ti", pretrained=True)`` (or ``"lit_ti.in1k_authors"``, timm's ``name.tag``
form), ``create_detector(..., pretrained=True)`` and ``create_segmenter(..., pretrained=True)``
look their file up here; :mod:`lgvit.models.download` fetches and caches it. Every fact below
(file, release, accuracy, licence) is read from the authors' READMEs and release pages; the
accuracies are theirs (their paper's and README's), not measured here.

The LSA authors publish their models only in a Google Drive folder (linked from the README of
github.com/shellysheynin/Locally-SAG-Transformer), which has no stable per-file URL: they have no
entry; load a file by hand with ``checkpoint_path=``.

Nothing here builds a model: the module holds facts and looks them up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lgvit.core.errors import LgvitError
from lgvit.task_table import CLASSIFICATION, get_task

__all__ = [
    "Weights",
    "WEIGHTS",
    "default_weights",
    "find_weights",
    "models_with_weights",
    "resolve_weights",
    "split_tag",
]


_LIT = dict(
    license="apache-2.0",
    origin_url="https://github.com/ziplab/LIT",
    paper_ids="arXiv:2105.14217",
    paper_name="Less is More: Pay Less Attention in Vision Transformers (AAAI 2022)",
)
_LOCALVIT = dict(
    license="mit",
    origin_url="https://github.com/ofsoundof/LocalViT",
    paper_ids="arXiv:2104.05707",
    paper_name="LocalViT: Analyzing Locality in Vision Transformers (IROS 2023)",
)
_LIT_V1 = "https://github.com/ziplab/LIT/releases/download/v1.0/"
_LIT_V2 = "https://github.com/ziplab/LIT/releases/download/v2.0/"
# The same repository under its former owner; GitHub redirects either name.
_LIT_V21 = "https://github.com/zhuang-group/LIT/releases/download/v2.1/"
_LOCALVIT_V1 = "https://github.com/ofsoundof/LocalViT/releases/download/v1.0.0/"


@dataclass(frozen=True)
class Weights:
    """One released checkpoint.

    ``model`` is the registered lgvit model (for a detector or a segmenter: its backbone);
    ``metrics`` the accuracy its authors report (``top1``/``top5`` on ImageNet-1k val,
    ``box_ap``/``mask_ap`` on COCO val2017, ``miou`` on ADE20K val, in %). ``sha256`` pins the
    file where known; otherwise the hash of the first download is recorded beside the cached
    file and every later file under that name must match it.
    """

    model: str
    tag: str
    url: str
    task: str = CLASSIFICATION  # a name of lgvit.task_table's TASKS
    detector: str | None = None  # retinanet | maskrcnn, for task "detection"
    dataset: str = "imagenet"
    num_classes: int = 1000
    license: str = ""
    origin_url: str = ""
    paper_ids: str = ""
    paper_name: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    sha256: str | None = None
    decimals: int = 1  # as the README prints the accuracy (LocalViT: 75.90)

    @property
    def name(self) -> str:
        """``model.tag``, timm's spelling."""
        return f"{self.model}.{self.tag}"

    @property
    def filename(self) -> str:
        """The released file's name (the last part of its URL): its name in the cache."""
        return self.url.rsplit("/", 1)[-1]

    def pretrained_cfg(self) -> dict[str, Any]:
        """timm's ``pretrained_cfg`` keys this entry fills (``url``, ``tag``, ``license``,
        ``origin_url``, ``paper_ids``, ``paper_name``, ``num_classes``, ``notes``)."""
        notes = (self.notes,) if self.notes else None
        return dict(url=self.url, tag=self.tag, license=self.license,
                    origin_url=self.origin_url, paper_ids=self.paper_ids,
                    paper_name=self.paper_name, num_classes=self.num_classes,
                    notes=notes)  # fmt: skip

    def describe_metrics(self) -> str:
        """The reported accuracy in words: ``top-1 81.1%``, ``box AP 42.0, mask AP 39.1``."""
        words = {"top1": "top-1 {}%", "top5": "top-5 {}%", "box_ap": "box AP {}",
                 "mask_ap": "mask AP {}", "miou": "mIoU {}"}  # fmt: skip
        return ", ".join(words[k].format(f"{v:.{self.decimals}f}") for k, v in self.metrics.items())


def _lit(model: str, tag: str, url: str, **kw: Any) -> Weights:
    return Weights(model, tag, url, **_LIT, **kw)


def _localvit(model: str, file: str, top1: float, top5: float) -> Weights:
    return Weights(model, "in1k_authors", _LOCALVIT_V1 + file, **_LOCALVIT,
                   metrics=dict(top1=top1, top5=top5), decimals=2)  # fmt: skip


_COCO = dict(task="detection", dataset="coco", num_classes=80)
_ADE = dict(task="segmentation", dataset="ade20k", num_classes=150)
_SEMFPN_NOTE = (
    "The README's table says 8k iterations; the config it links "
    "(lit_*_fpn_r50_512x512_80k_ade20k.py) trains 80k."
)

# The first entry of a model for a task is its default (``create_model("lit_ti",
# pretrained=True)``).
WEIGHTS: tuple[Weights, ...] = (
    # ziplab/LIT release v1.0: ImageNet-1k classification (README "Image Classification").
    _lit("lit_ti", "in1k_authors", _LIT_V1 + "lit_ti.pth", metrics=dict(top1=81.1)),
    _lit("lit_s", "in1k_authors", _LIT_V1 + "lit_s.pth", metrics=dict(top1=81.5)),
    _lit("lit_m", "in1k_authors", _LIT_V1 + "lit_m.pth", metrics=dict(top1=83.0)),
    _lit("lit_b", "in1k_authors", _LIT_V1 + "lit_b.pth", metrics=dict(top1=83.4)),
    # ziplab/LIT release v2.0: COCO 1x (mmdetection 2.11) and ADE20K (mmsegmentation 0.13).
    _lit("lit_ti", "coco_retinanet_authors", _LIT_V2 + "retina_lit_ti.pth", **_COCO,
         detector="retinanet", metrics=dict(box_ap=41.6)),
    _lit("lit_s", "coco_retinanet_authors", _LIT_V2 + "retina_lit_s.pth", **_COCO,
         detector="retinanet", metrics=dict(box_ap=41.6)),
    _lit("lit_ti", "coco_maskrcnn_authors", _LIT_V2 + "mask_rcnn_lit_ti.pth", **_COCO,
         detector="maskrcnn", metrics=dict(box_ap=42.0, mask_ap=39.1)),
    _lit("lit_s", "coco_maskrcnn_authors", _LIT_V2 + "mask_rcnn_lit_s.pth", **_COCO,
         detector="maskrcnn", metrics=dict(box_ap=42.9, mask_ap=39.6)),
    _lit("lit_ti", "ade20k_semfpn_authors", _LIT_V2 + "sem_fpn_lit_ti.pth", **_ADE,
         metrics=dict(miou=41.3), notes=_SEMFPN_NOTE),
    _lit("lit_s", "ade20k_semfpn_authors", _LIT_V2 + "sem_fpn_lit_s.pth", **_ADE,
         metrics=dict(miou=41.7), notes=_SEMFPN_NOTE),
    # zhuang-group/LIT release v2.1: PVT-S with full attention in every stage (the LIT paper's
    # Table 4 first row; README "Attention Map Visualisation", their pvt_small_full_msa).
    _lit("pvt_small_full_msa", "in1k_authors", _LIT_V21 + "pvt_full_msa.pth",
         metrics=dict(top1=80.9)),
    # ofsoundof/LocalViT release v1.0.0 (README "Model Zoo", top-1 / top-5).
    _localvit("localvit_tiny", "localvit_t.pth", 74.84, 92.61),
    _localvit("localvit_tiny_se4", "localvit_t_se4.pth", 75.74, 93.05),
    _localvit("localvit_small", "localvit_s.pth", 80.78, 95.38),
    _localvit("localvit_pvt_tiny", "localvit_pvt.pth", 78.14, 94.24),
    _localvit("localvit_tnt_tiny", "localvit_tnt.pth", 75.90, 92.90),
    _localvit("localvit_swin_tiny", "localvit_swin.pth", 81.86, 95.72),
)  # fmt: skip

_BY_NAME = {w.name: w for w in WEIGHTS}
assert len(_BY_NAME) == len(WEIGHTS), "a model.tag is listed twice"
assert len({w.filename for w in WEIGHTS}) == len(WEIGHTS), "two entries share a file name"


def split_tag(name: str) -> tuple[str, str]:
    """``"lit_ti.in1k_authors"`` -> ``("lit_ti", "in1k_authors")``; no tag: ``(name, "")``."""
    model, _, tag = name.partition(".")
    return model, tag


def find_weights(name: str) -> Weights | None:
    """The entry called ``model.tag``, if any (no lookup by bare model name)."""
    return _BY_NAME.get(name)


def models_with_weights(task: str | None = None) -> list[str]:
    """Models with released weights (for ``task``: classification, detection, segmentation)."""
    return sorted({w.model for w in WEIGHTS if task is None or w.task == task})


def weights_of(model: str) -> list[Weights]:
    """Every entry of ``model``, in the table's order."""
    return [w for w in WEIGHTS if w.model == model]


def default_weights(model: str, task: str = CLASSIFICATION,
                    detector: str | None = None) -> Weights | None:  # fmt: skip
    """``model``'s first entry for ``task`` (and ``detector``), or None."""
    return next((w for w in WEIGHTS if w.model == model and w.task == task
                 and (detector is None or w.detector == detector)), None)  # fmt: skip


def _builder(w: Weights) -> str:
    return get_task(w.task).loads_released.format(name=w.name, model=w.model, detector=w.detector)


def resolve_weights(name: str, task: str = CLASSIFICATION,
                    detector: str | None = None) -> Weights:  # fmt: skip
    """The entry ``name`` (``model`` or ``model.tag``) stands for when ``task`` is built.

    A model without weights for ``task``, an unknown tag, or a tag of another task (a detector's
    weights asked of ``create_model``) is one line saying which names have weights.
    """
    model, tag = split_tag(name)
    if tag:
        w = find_weights(name)
        if w is None:
            have = ", ".join(x.name for x in weights_of(model))
            have = f"those of {model}: {have}" if have else f"{model} has none"
            raise LgvitError(f"{name}: no such weights ({have}; `lgvit weights list` lists "
                             "them all)")  # fmt: skip
        if w.task != task or (detector is not None and w.detector != detector):
            raise LgvitError(f"{name} are {w.task} weights ({w.describe_metrics()}): load them "
                             f"with {_builder(w)}")  # fmt: skip
        return w
    w = default_weights(model, task, detector)
    if w is None:
        what = f"{detector} " if detector else ""
        have = ", ".join(models_with_weights(task)) or "none"
        raise LgvitError(
            f"{model}: no released {what}{task} weights to download (models with them: {have}; "
            "`lgvit weights list`); pass checkpoint_path=FILE for weights of your own"
        )
    return w
