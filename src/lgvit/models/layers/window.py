"""Swin's (shifted-)window attention: the shared :class:`Attention` inside each window."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lgvit.models.layers.attention import Attention
from lgvit.models.layers.helpers import Grid


def window_partition(x: torch.Tensor, hw: Grid, window: int) -> torch.Tensor:
    """``(B, H*W, C)`` -> ``(B * nW, window*window, C)``, windows in row-major order."""
    B, _, C = x.shape
    H, W = hw
    x = x.view(B, H // window, window, W // window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, C)


def window_reverse(x: torch.Tensor, hw: Grid, window: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`."""
    H, W = hw
    C = x.shape[-1]
    x = x.view(-1, H // window, W // window, window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, H * W, C)


def shifted_window_mask(hw: Grid, window: int, shift: int) -> torch.Tensor:
    """``(nW, w*w, w*w)`` additive mask: after the cyclic shift, tokens from different regions
    of the map must not attend to each other inside one window (-100, as Swin)."""
    H, W = hw
    region = torch.zeros(H, W)
    cnt = 0
    for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
        for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            region[hs, ws] = cnt
            cnt += 1
    r = window_partition(region.view(1, H * W, 1), hw, window)[..., 0]  # (nW, w*w)
    return (r[:, None, :] != r[:, :, None]).float() * -100.0


class WindowAttention(Attention):
    """:class:`Attention` inside non-overlapping ``window x window`` windows, optionally
    cyclically shifted by ``shift`` (Swin), with a relative-position bias over the window.

    ``pad_to_window`` (set by the dense backbone mode): a grid that is not a multiple of the
    window is zero-padded at the bottom and right (after the block's norm), attended over with
    the shift mask of the padded grid and cropped back, as Swin's detection and segmentation
    backbones do; otherwise such a grid is an error."""

    # Why an exported graph cannot take other input sizes (``lgvit export --dynamic-size``).
    fixed_grid_reason = (
        "window attention needs every stage's token grid to be a multiple of the window; "
        "export once per input size (--img-size)"
    )

    def __init__(
        self, dim: int, num_heads: int, *, window: int = 7, shift: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, rel_pos_grid=window, **kwargs)
        self.window = window
        self.shift = shift
        self.pad_to_window = False
        self._masks: dict[tuple[Grid, str], torch.Tensor] = {}

    def _mask(self, hw: Grid, device: torch.device) -> torch.Tensor:
        if torch.compiler.is_compiling():  # in the graph: a cache entry added while tracing
            return shifted_window_mask(hw, self.window, self.shift).to(device)  # recompiles
        key = (tuple(hw), str(device))
        if key not in self._masks:  # built once per grid and device, not per call
            self._masks[key] = shifted_window_mask(hw, self.window, self.shift).to(device)
        return self._masks[key]

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, hw: Grid, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return window_attention(self, x, hw)

    def forward_windows(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        H, W = hw
        w = self.window
        if H % w or W % w:
            if not self.pad_to_window:
                raise ValueError(f"token grid {H}x{W} is not divisible by the window {w}")
            return self._forward_padded(x, hw)
        B, N, C = x.shape
        s = self.shift
        if s:
            x = torch.roll(x.view(B, H, W, C), (-s, -s), (1, 2)).view(B, N, C)
        mask = None
        if s:
            # (nW, 1, w*w, w*w): one mask per window, repeating over the images (windows are
            # image-major) and shared by every head; added by broadcasting, not copied B times
            # (at batch 32 that copy, widened per head, was a 59 MB float32 tensor per block).
            mask = self._mask(hw, x.device).unsqueeze(1)
        y = super().forward(window_partition(x, hw, w), attn_mask=mask)
        y = window_reverse(y, hw, w)
        if s:
            y = torch.roll(y.view(B, H, W, C), (s, s), (1, 2)).view(B, N, C)
        return y

    def _forward_padded(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        B, _, C = x.shape
        H, W = hw
        w = self.window
        Hp, Wp = -(-H // w) * w, -(-W // w) * w
        x = F.pad(x.view(B, H, W, C), (0, 0, 0, Wp - W, 0, Hp - H))
        y = self.forward_windows(x.view(B, Hp * Wp, C), (Hp, Wp))
        return y.view(B, Hp, Wp, C)[:, :H, :W].reshape(B, H * W, C)


def window_attention(attn: WindowAttention, x: torch.Tensor, hw: Grid) -> torch.Tensor:
    """``attn(x, hw)``; one torch.fx graph node: the windows, their padding and the cached
    masks depend on the grid."""
    return attn.forward_windows(x, hw)


torch.fx.wrap("window_attention")
