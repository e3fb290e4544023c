"""The base every model stands on: a stem, a list of stages, a head -- and timm's interface.

A family writes ``forward_stem(x) -> (tokens, grid)`` and builds ``self.stages`` (a
``ModuleList`` whose entries are called ``stage(x, hw)`` and return ``(x, hw)`` -- a
:class:`~lgvit.models.layers.Stage` -- or ``x`` -- a plain ViT's blocks, each its own feature
level). It then calls :meth:`StagedViT.init_head`. The base owns everything a timm user calls:
``forward_features``, ``forward_head``, ``forward_intermediates``,
``prune_intermediate_layers``, ``feature_info``, ``reset_classifier``, ``get_classifier``,
``no_weight_decay`` (by parameter-name patterns), ``group_matcher`` and
``set_grad_checkpointing``; and what a dense backbone (:mod:`lgvit.dense.backbone`) asks of a
family: ``dense_out_norms``, ``dense_built_for_input_size``, :meth:`StagedViT.dense_size_divisor`
and :meth:`StagedViT.set_dense_mode`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.layers import (
    LN_EPS,
    FeatureInfo,
    Grid,
    Stage,
    WindowAttention,
    autocast_dtype,
    feature_take_indices,
    init_vit_weights,
    num_prefix_tokens,
    run_block,
)

POOLS = ("avg", "token", "")


def block_feature_info(dim: int, reduction: int, depth: int) -> FeatureInfo:
    """``feature_info`` of a plain ViT: every block is a feature level at one stride."""
    return FeatureInfo(
        dict(num_chs=dim, reduction=reduction, module=f"blocks.{i}") for i in range(depth)
    )


def pyramid_feature_info(dims: Sequence[int], first_reduction: int) -> FeatureInfo:
    """``feature_info`` of a pyramid whose stage i is ``dims[i]`` wide at stride
    ``first_reduction * 2**i``."""
    return FeatureInfo(
        dict(num_chs=d, reduction=first_reduction * 2**i, module=f"stages.{i}")
        for i, d in enumerate(dims)
    )


def check_image(x: torch.Tensor, in_chans: int, weight: torch.Tensor | None) -> torch.Tensor:
    """``x``, or one clear error for an input that is not a batch of images with ``in_chans``
    channels, or not in the floating-point type of ``weight`` (the model's): an image as read
    (uint8, 0-255) must be converted and normalised first, and another float type (float64
    into float32 weights) is refused rather than cast, as it would not run. Under autocast the
    input's float type is autocast's to choose."""
    if x.ndim != 4 or x.shape[1] != in_chans:
        raise ValueError(f"expected input (B, {in_chans}, H, W), got {tuple(x.shape)}")
    got = str(x.dtype).removeprefix("torch.")
    if not x.is_floating_point():
        raise ValueError(
            f"expected a floating-point image batch, got {got}; convert and normalise it "
            "first (x.float() / 255, then the model's mean and std)"
        )
    want = x.dtype if weight is None else weight.dtype
    if x.dtype != want and autocast_dtype(x.device.type) is None:
        want_name = str(want).removeprefix("torch.")
        raise ValueError(
            f"input is {got} but the model's weights are {want_name}: pass "
            f"x.to(torch.{want_name}) (or convert the model with .to(torch.{got}))"
        )
    return x


def stem_of_no_images(
    stem: Callable[[torch.Tensor], tuple[torch.Tensor, Grid]], x: torch.Tensor, *modules: nn.Module
) -> tuple[torch.Tensor, Grid]:
    """``stem(x)`` for a batch of 0 images, for a stem that cannot run one (LSA's shifted-patch
    gather): the stem of one blank image with none of its tokens kept, so the shapes that
    follow are right. The stem's ``modules`` run in eval mode: no normalisation statistic
    moves."""
    modes = [m.training for m in modules]
    for m in modules:
        m.train(False)
    try:
        tokens, grid = stem(x.new_zeros((1, *x.shape[1:])))
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
    return tokens[:0], grid


# torch.fx: one graph node that runs the checks at run time (they branch on the input's shape
# and dtype, which a symbolic trace cannot).
torch.fx.wrap("check_image")


class StagedViT(nn.Module):
    """Stem -> stages -> final norm -> pooled head.

    Class attributes a family may set:
        stages_attr: the attribute holding the stages (``"blocks"`` for plain ViTs).
        stem_pattern: regex of the stem's parameter names, for :meth:`group_matcher` (groups
            non-capturing: timm turns every captured group into a number).
        no_weight_decay_patterns: ``fnmatch`` patterns of parameter names kept out of weight
            decay (position embeddings, class tokens, relative-position tables).
        norm_intermediates: ``forward_intermediates(norm=True)`` normalises every feature
            (plain ViTs, one width) rather than only the last (pyramids).
        dense_out_norms: the output norms of the family's dense backbones as their authors
            wrote them: ``per_level`` (a new LayerNorm on every map: Swin's and LIT-S's
            ``norm{i}``, LSA) or ``none`` (PVT's and LIT-Ti's).
        dense_built_for_input_size: a dense backbone is built for the dense input size (Swin:
            LIT-S/M/B's relative-position tables span a whole stage map, and windows shift
            only in maps larger than a window), not the classification one.
    """

    stages_attr = "stages"
    stem_pattern = r"^(?:patch_embed|pos_embed|cls_token)"
    no_weight_decay_patterns: tuple[str, ...] = (
        "pos_embed", "*.pos_embed", "cls_token", "*.cls_token", "*relative_position_bias_table",
    )  # fmt: skip
    norm_intermediates = False
    dense_out_norms = "per_level"
    dense_built_for_input_size = False

    num_classes: int
    num_features: int
    global_pool: str
    img_size: Grid
    in_chans: int
    feature_info: FeatureInfo
    pretrained_cfg: dict[str, Any]

    # -- sharing: the Hugging Face hub layout (lgvit.models.hub) ----------------------------------

    def save_pretrained(self, directory: str) -> Any:
        """Write ``config.json`` + ``model.safetensors`` (timm's hub layout) into ``directory``;
        ``create_model("local-dir:DIR")`` loads it back."""
        from lgvit.models.hub import save_pretrained

        return save_pretrained(self, directory)

    def push_to_hub(self, repo_id: str, private: bool = False) -> str:
        """Upload in the hub layout (needs ``huggingface_hub`` and the network)."""
        from lgvit.models.hub import push_to_hub

        return push_to_hub(self, repo_id, private=private)

    # -- what a family provides ------------------------------------------------------------

    def forward_stem(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        raise NotImplementedError

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, checked by :func:`check_image` against the model's channels and weights; a
        family calls ``x = self.check_input(x)`` so a traced graph keeps the check."""
        weight = None
        for p in self.parameters():  # a loop, not a generator: torch.compile traces it whole
            if p.is_floating_point():
                weight = p
                break
        return check_image(x, self.in_chans, weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # Module.to(memory_format=torch.channels_last) converts every 4-D and 5-D tensor, and a
        # 5-D one cannot take that 4-D format: LSA's stacked conv weights (T, out, in, k, k) are
        # converted as the T*out 4-D conv filters they are, and keep their shape.
        def convert(t: torch.Tensor) -> torch.Tensor:
            return fn(t.flatten(0, 1)).view(t.shape) if t.ndim == 5 else fn(t)

        return super()._apply(convert, recurse)

    def tokens_of(self, x: Any) -> torch.Tensor:
        """The tokens in what the stages pass on (TNT passes pixel and patch tokens)."""
        return x

    def init_head(
        self,
        num_features: int,
        num_classes: int,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
    ) -> None:
        """Final norm, pooling (``avg`` over image tokens, ``token`` = the class token) and the
        linear classifier (``num_classes=0``: none, the pooled features come out)."""
        if global_pool not in POOLS:
            raise ValueError(f"global_pool {global_pool!r} is not one of {POOLS}")
        self.num_features = self.head_hidden_size = num_features
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.norm = (
            norm_layer(num_features) if norm_layer else nn.LayerNorm(num_features, eps=LN_EPS)
        )
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False
        if not hasattr(self, "pretrained_cfg"):
            self.pretrained_cfg = {}

    # -- stages ----------------------------------------------------------------------------

    def stage_list(self) -> nn.ModuleList:
        return getattr(self, self.stages_attr)

    def _run(self, stage: nn.Module, x: torch.Tensor, hw: Grid) -> tuple[torch.Tensor, Grid]:
        if isinstance(stage, Stage):
            return stage(x, hw)
        return run_block(stage, x, hw, self.grad_checkpointing), hw

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Image -> the final features after the final norm, in :attr:`output_fmt`: the map
        ``(B, H, W, C)`` of a model without class tokens (a pyramid, as timm's Swin), else the
        tokens ``(B, N, C)`` with the class token first (as timm's ViT)."""
        x, hw = self.forward_stem(x)
        for stage in self.stage_list():
            x, hw = self._run(stage, x, hw)
        return self._final(x, hw)

    def _final(self, x: Any, hw: Grid) -> torch.Tensor:
        x = self.norm(self.tokens_of(x))
        if self.output_fmt == "NHWC":  # a view: the tokens are the map in row-major order
            x = x.reshape(x.shape[0], hw[0], hw[1], x.shape[-1])
        return x

    @property
    def output_fmt(self) -> str:
        """timm's: the layout :meth:`forward_features` returns (``NHWC`` map or ``NLC``
        tokens, the class token among them)."""
        return "NLC" if self.num_prefix_tokens else "NHWC"

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool (``token``: the class token; ``avg``: the mean of the image tokens or of the
        map; ``""``: none) and classify."""
        if self.global_pool == "token":
            x = x[:, 0]
        elif self.global_pool == "avg":
            nhwc = self.output_fmt == "NHWC"
            x = x.mean(dim=(1, 2)) if nhwc else x[:, self.num_prefix_tokens :].mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @property
    def num_prefix_tokens(self) -> int:
        """Class tokens in front of the final stage's image tokens."""
        stages = self.stage_list()
        return getattr(stages[-1], "num_prefix_tokens", 0) if len(stages) else 0

    # -- features --------------------------------------------------------------------------

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Feature maps of the chosen stages (timm's signature).

        ``indices``: None = every stage, an int n = the last n, a list = those. ``norm``
        applies the final norm (to the last stage's map; to every map in a plain ViT).
        ``stop_early`` skips the stages after the last one asked for. ``output_fmt`` ``NCHW``
        or ``NHWC``. Returns ``(final_tokens, maps)``, or only ``maps`` when
        ``intermediates_only``. Class tokens are not part of the maps.
        """
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"output_fmt {output_fmt!r} is not NCHW or NHWC")
        stages = self.stage_list()
        take = self.take_indices(indices)
        last = len(stages) - 1
        run = stages[: max(take) + 1] if stop_early else stages
        x, hw = self.forward_stem(x)
        maps = []
        for i, stage in enumerate(run):
            x, hw = self._run(stage, x, hw)
            if i in take:
                t = self.tokens_of(x)
                t = self.norm(t) if norm and (self.norm_intermediates or i == last) else t
                t = t[:, num_prefix_tokens(t, hw) :]
                t = t.reshape(t.shape[0], hw[0], hw[1], t.shape[-1])  # batch 0 too
                maps.append(t if output_fmt == "NHWC" else t.permute(0, 3, 1, 2).contiguous())
        if intermediates_only:
            return maps
        return self._final(x, hw), maps

    def take_indices(self, indices: int | Sequence[int] | None) -> list[int]:
        """The stages ``indices`` asks for (see :meth:`forward_intermediates`); at least one."""
        n = len(self.stage_list())
        take = feature_take_indices(n, indices)
        if not take:
            raise ValueError(
                f"indices={indices!r} asks for no feature level; choose from 0 to {n - 1} "
                "(or None: all of them)"
            )
        return take

    def prune_intermediate_layers(
        self,
        indices: int | Sequence[int] = 1,
        prune_norm: bool = False,
        prune_head: bool = True,
    ) -> list[int]:
        """Drop the stages after the last one ``indices`` asks for (and the norm, the head)."""
        stages = self.stage_list()
        take = self.take_indices(indices)
        setattr(self, self.stages_attr, stages[: max(take) + 1])
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take

    # -- head ------------------------------------------------------------------------------

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            if global_pool not in POOLS:
                raise ValueError(f"global_pool {global_pool!r} is not one of {POOLS}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        device = next(self.parameters()).device
        self.head = (
            nn.Linear(self.num_features, num_classes, device=device)
            if num_classes > 0
            else nn.Identity()
        )
        if num_classes > 0:
            init_vit_weights(self.head)

    # -- dense prediction (lgvit.dense.backbone asks; a family overrides) -------------------

    def dense_size_divisor(self) -> int:
        """A dense backbone zero-pads its input at the bottom and right to a multiple of this;
        1: any size goes in as it is (PVT's and LSA's strided convolutions floor odd sizes)."""
        return 1

    def set_dense_mode(self) -> None:
        """Take any input size, as the authors' dense backbones do (a dense backbone calls it
        once, after the weights are loaded): window attention pads a grid that is not a
        multiple of its window."""
        for m in self.modules():
            if isinstance(m, WindowAttention):
                m.pad_to_window = True

    # -- training helpers ------------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters kept out of weight decay, by name pattern (norms and biases are 1-D and
        skipped by the optimizer's grouping as well)."""
        pats = self.no_weight_decay_patterns
        return {n for n, _ in self.named_parameters() if any(fnmatch.fnmatch(n, p) for p in pats)}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's parameter grouping (layer-wise lr decay): stem, one group per stage
        (``coarse``) or per block, then the final norm; the head falls outside (last group)."""
        s = self.stages_attr
        if self.stages_attr == "blocks":
            blocks: Any = [(rf"^{s}\.(\d+)", None), (r"^norm", (99999,))]
        elif coarse:
            blocks = [(rf"^{s}\.(\d+)", None), (r"^norm", (99999,))]
        else:
            blocks = [
                (rf"^{s}\.(\d+)\.blocks\.(\d+)", None),
                # Non-capturing: timm turns every captured group into a number.
                (rf"^{s}\.(\d+)\.(?:downsample|cls_token|pos_embed)", (0,)),
                (r"^norm", (99999,)),
            ]
        return {"stem": self.stem_pattern, "blocks": blocks}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing per block: activations are recomputed in the backward pass
        (less memory, ~1/3 more compute). BatchNorm statistics are not counted twice."""
        self.grad_checkpointing = enable
        for m in self.modules():
            if isinstance(m, Stage):
                m.grad_checkpointing = enable

    @property
    def default_cfg(self) -> dict[str, Any]:
        """timm's older name of :attr:`pretrained_cfg` (the same dict)."""
        return self.pretrained_cfg

    @default_cfg.setter
    def default_cfg(self, cfg: dict[str, Any]) -> None:  # timm's builders assign it
        self.pretrained_cfg = cfg

    def load_state_dict(
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> Any:  # fmt: skip
        """``nn.Module.load_state_dict`` after :meth:`checkpoint_filter_fn`: the authors'
        released layouts load wherever a state dict is loaded (timm's ``checkpoint_path``,
        user code); lgvit's own keys pass through."""
        return super().load_state_dict(self.checkpoint_filter_fn(state_dict), strict, assign)

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map a checkpoint in another layout (the authors' releases) to this model's keys.
        lgvit's own checkpoints pass through unchanged."""
        return state_dict
