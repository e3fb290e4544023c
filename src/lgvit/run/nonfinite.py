"""Non-finite losses: the step skipped, counted, and the run stopped past ``max_nonfinite``.

On a GPU the skip costs no host sync: reading a loss on the host makes it wait for the whole
step, and the host could not prepare the next batch meanwhile. There the optimizer is handed a
``found_inf`` flag on the device, the way :class:`torch.amp.GradScaler` hands it to optimizers
that take one (torch's fused AdamW and SGD, lgvit's LAMB): their step leaves the weights and
their state alone when it is set. The count stays on the device and is read at log time. On a
CPU (a sync costs nothing there) and for an optimizer without the flag, the host checks each
loss and skips the call, as it always did.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.errors import LgvitError
from lgvit.run.config import TrainConfig


class NonFiniteLoss(LgvitError):
    pass


def stop_nonfinite(cfg: TrainConfig, what: str) -> None:
    kept = (
        f"the last good checkpoint is kept in {cfg.out}"
        if RunLayout(cfg.out).last_weights.exists()
        else "no checkpoint had been saved yet"
    )
    raise NonFiniteLoss(f"{what}; stopping. {kept} (lower --set lr=... or try --amp none)")


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer's step reads ``found_inf`` (GradScaler's protocol): torch sets
    ``_step_supports_amp_scaling`` on its fused optimizers only; lgvit's LAMB sets it too."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def skips_on_device(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, device: torch.device
) -> bool:
    """Whether a non-finite loss is skipped on the device, with no host sync per step: on a GPU,
    for an optimizer that takes ``found_inf`` (with fp16's GradScaler too, whose own check then
    skips the step). Elsewhere the host checks each loss."""
    return device.type == "cuda" and takes_found_inf(optimizer)


class NonFiniteGuard:
    """One epoch's non-finite losses: :meth:`before_step` for each micro-batch, the step
    (backward of :meth:`backward_loss`; ``bad``, the device flag, for the EMA),
    :meth:`finite_part`, and :meth:`check` at log time. With gradient accumulation a non-finite
    micro-batch skips its whole window's step (its gradients are in the sum), counted once."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        cfg: TrainConfig,
        device: torch.device,
        distributed: bool = False,
    ) -> None:
        self.optimizer, self.scaler, self.cfg = optimizer, scaler, cfg
        self.distributed = distributed
        self.on_device = skips_on_device(optimizer, scaler, device)
        self.count_dev = torch.zeros((), dtype=torch.int64, device=device)
        self.count = 0
        self.bad: torch.Tensor | None = None  # the window's agreed flag, set at its last
        self._window: torch.Tensor | bool = False  # a non-finite loss so far in the window

    def before_step(
        self, loss: torch.Tensor, epoch: int, i: int, first: bool = True, last: bool = True
    ) -> bool:
        """Before a micro-batch's backward (a window's ``first`` clears the gradients): True
        when the host skips it and its window's step, with a warning. ``i``: the step."""
        if first:
            self.optimizer.zero_grad(set_to_none=True)
            self.bad, self._window = None, False
        if self.on_device:
            bad = (~torch.isfinite(loss.detach())).to(torch.int32)
            self._window = bad if first else torch.maximum(self._window, bad)  # type: ignore
            if last:
                self._agree(self._window)  # type: ignore[arg-type]
            return False
        if self._window:  # the window's step is skipped already
            return True
        if torch.isfinite(loss):
            return False
        self.count += 1
        self._window = True
        where = f"loss is {loss.item()} at epoch {epoch + 1} step {i + 1}"
        if self.count > self.cfg.max_nonfinite:
            stop_nonfinite(self.cfg, where)
        warnings.warn(f"{where}: skipped", stacklevel=3)
        return True

    def _agree(self, bad: torch.Tensor) -> None:
        """The window's flag, the same on every rank, counted and handed to the optimizer."""
        if self.distributed:  # DDP averages one rank's NaN into every rank's gradients:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # all skip (and count) together
        self.bad = bad.bool()
        self.count_dev += self.bad
        if self.scaler is None:  # as a GradScaler hands it over (it sets its own)
            self.optimizer.grad_scale = None  # type: ignore[attr-defined]
            self.optimizer.found_inf = self.bad.float()  # type: ignore[attr-defined]

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate. Under a GradScaler a non-finite loss makes every gradient
        NaN (x NaN), so the scaler's own check skips the step (it also lowers its scale, as for
        any overflow); without one the optimizer reads the ``found_inf`` set above."""
        if self.bad is None or self.scaler is None:
            return loss
        return loss * torch.where(self.bad, float("nan"), 1.0)

    def finite_part(self, loss: torch.Tensor) -> torch.Tensor:
        """After the step: the loss to sum (0 for a step skipped on the device; before a
        window's last micro-batch, 0 for a non-finite loss)."""
        if self.bad is None:
            if self.on_device:
                return torch.where(torch.isfinite(loss), loss.detach(), 0.0)
            return loss.detach()
        for name in ("grad_scale", "found_inf"):
            if hasattr(self.optimizer, name):
                delattr(self.optimizer, name)
        return torch.where(self.bad, 0.0, loss.detach())

    def check(self, where: str) -> None:
        """Stop past ``max_nonfinite``: the device count is read here (at log time) only."""
        if self.on_device and int(self.count_dev) > self.cfg.max_nonfinite:
            stop_nonfinite(self.cfg, f"{int(self.count_dev)} non-finite losses {where}")
