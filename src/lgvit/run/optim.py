"""Optimisation: parameter groups, optimizers (AdamW, SGD, LAMB), the learning-rate schedule
and the EMA of the weights."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.layers.attention import unfused_qkv_names
from lgvit.run.config import TrainConfig


def steps_per_epoch(cfg: TrainConfig, batches: int) -> int:
    """An epoch's optimizer steps: its ``batches`` in windows of ``grad_accum_steps`` (a last
    partial window steps too, as timm's). Schedules, budgets and logs count these steps."""
    return -(-batches // cfg.grad_accum_steps)


def run_epochs(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """The run's epochs: ``epochs``, or as many as an iteration budget (``iters``) needs (the
    last one stops at the budget)."""
    return -(-cfg.iters // steps_per_epoch) if cfg.iters else cfg.epochs


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """The warm-up's steps: ``warmup_iters``, or ``warmup_epochs`` of steps."""
    if cfg.warmup_iters is not None:
        return cfg.warmup_iters
    return int(cfg.warmup_epochs * steps_per_epoch)


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """The run's optimizer steps: ``iters``, or ``epochs`` whole epochs."""
    return cfg.iters if cfg.iters else cfg.epochs * steps_per_epoch


def lr_at(
    step: int,
    total_steps: int,
    warmup_steps: int,
    cfg: TrainConfig,
    base_lr: float,
    steps_per_epoch: int = 1,
) -> float:
    """Linear warm-up from warmup_lr, then (``sched``) per-step cosine decay from base_lr to
    min_lr, a per-step linear or poly (``poly_power``) decay from base_lr to min_lr, a step
    decay by ``decay_rate`` every ``decay_epochs`` (or after each of ``decay_milestones``), or
    a constant base_lr."""
    if step < warmup_steps:
        return cfg.warmup_lr + (base_lr - cfg.warmup_lr) * step / warmup_steps
    if cfg.sched == "none":
        return base_lr
    if cfg.sched == "step":
        epochs = step / max(steps_per_epoch, 1)
        if cfg.decay_milestones:  # mmdet's step=[8, 11]: x rate after epoch 8, again after 11
            decays = sum(epochs >= m for m in cfg.decay_milestones)
        else:
            decays = math.floor(epochs / cfg.decay_epochs)
        return max(base_lr * cfg.decay_rate**decays, cfg.min_lr)
    t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if cfg.sched == "linear":
        return cfg.min_lr + (base_lr - cfg.min_lr) * (1.0 - min(t, 1.0))
    if cfg.sched == "poly":  # mmcv's PolyLrUpdaterHook (per iteration)
        return cfg.min_lr + (base_lr - cfg.min_lr) * (1.0 - min(t, 1.0)) ** cfg.poly_power
    return cfg.min_lr + 0.5 * (base_lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def warn_long_warmup(cfg: TrainConfig, schedule: dict[str, Any]) -> None:
    """A warm-up as long as the run never reaches the peak lr: a warning (a short test run of
    a long recipe, most likely) rather than a silently different schedule."""
    if schedule["warmup_steps"] > 0 and schedule["warmup_steps"] >= schedule["total_steps"]:
        final = lr_at(schedule["total_steps"] - 1, **schedule)
        run_is = f"the {cfg.iters}-iteration budget" if cfg.iters else f"epochs {cfg.epochs}"
        key = "warmup_iters" if cfg.warmup_iters is not None else "warmup_epochs"
        warnings.warn(
            f"{key} {getattr(cfg, key):g} >= {run_is}: the learning rate "
            f"rises for the whole run and ends at {final:.3g}, below its peak "
            f"{schedule['base_lr']:.3g} (lower --set {key}=...)",
            stacklevel=3,
        )


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020): Adam's update with decoupled weight decay, scaled per tensor by
    the trust ratio ``||w|| / ||update||`` (1 where either norm is zero), as timm's ``lamb``.

    Like torch's fused optimizers it takes ``found_inf`` (and ``grad_scale``) as a GradScaler
    hands them over: a step with ``found_inf`` set leaves the weights and the state as they
    were, decided on the device (:meth:`_step_on_device`)."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        if found_inf is not None or grad_scale is not None:
            self._step_on_device(found_inf, grad_scale)
            return None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.add_(_trusted_update(p, st, group), alpha=-group["lr"])
        return None

    def _step_on_device(self, found_inf: torch.Tensor | None, grad_scale: Any) -> None:
        """The step with no host sync: where ``found_inf`` is set, the moments take a zero
        weight, the step count adds 0 and the update is replaced by 0, so nothing changes. The
        step count is a device tensor here (the bias corrections are computed from it)."""
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                bad = torch.zeros((), dtype=torch.bool, device=p.device)
                if found_inf is not None:
                    bad = found_inf.to(p.device) > 0
                keep = (~bad).to(p.dtype)
                g = p.grad if grad_scale is None else p.grad / grad_scale.to(p.device)
                g = torch.where(bad, 0.0, g)  # a NaN gradient times a zero weight is still NaN
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                step = st.get("step", 0)  # new, saved by the host path, or loaded on the CPU
                if not torch.is_tensor(step) or step.device != p.device:
                    st["step"] = torch.as_tensor(step, dtype=torch.float32, device=p.device)
                st["step"] += keep
                st["m"].lerp_(g, keep * (1 - b1))
                st["v"].mul_(torch.where(bad, 1.0, b2)).addcmul_(g, g, value=1 - b2)
                # 0/0 on a skipped first step: where, not a product, keeps the weights exact
                p.add_(torch.where(bad, 0.0, _trusted_update(p, st, group)), alpha=-group["lr"])


def _trusted_update(p: torch.Tensor, st: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """LAMB's update of ``p`` from its bias-corrected moments, scaled by the trust ratio
    ||p|| / ||update|| (1 where either norm is 0)."""
    b1, b2 = group["betas"]
    m_hat = st["m"] / (1 - b1 ** st["step"])
    v_hat = st["v"] / (1 - b2 ** st["step"])
    update = m_hat / (v_hat.sqrt() + group["eps"])
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    w_norm, u_norm = p.norm(), update.norm()
    return update * torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)


def build_optimizer(
    cfg: TrainConfig, groups: list[dict[str, Any]], lr: float, device: torch.device
) -> torch.optim.Optimizer:
    """``opt``: AdamW (the papers'), SGD with Nesterov momentum, or LAMB."""
    if cfg.opt == "sgd":
        # Fused on a GPU: its step takes found_inf (a non-finite loss skipped with no sync).
        # The CPU keeps the foreach kernel its runs have always used.
        if device.type != "cuda":
            return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=True)
        sgd = torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=True, fused=True)
        # torch's fused SGD makes its buffers with empty_like just before its first step, which
        # a found_inf skips: they would stay uninitialised. Zeros make the first step's
        # momentum*0 + grad exactly the grad torch starts from (dampening 0).
        for group in sgd.param_groups:
            for p in group["params"]:
                sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return sgd
    if cfg.opt == "lamb":
        return Lamb(groups, lr=lr, betas=tuple(cfg.opt_betas), eps=cfg.opt_eps)
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.opt_betas), eps=cfg.opt_eps, **fused)


def param_groups(
    model: nn.Module,
    weight_decay: float,
    offset_lr_factor: float = 1.0,
    layer_decay: float | None = None,
) -> list[dict[str, Any]]:
    """Weight decay on weights only: not on position embeddings, norms or biases (DeiT).

    Sampling-offset weights (``*offset_conv.weight``, LIT's deformable token merging) train at
    ``offset_lr_factor`` x the learning rate, with weight decay, as the LIT authors' code does;
    their biases stay at the full rate without decay. ``lr_scale`` carries the factor.
    ``layer_decay`` (fine-tuning, BEiT's and timm's ``--layer-decay``): each layer's rate
    scaled by ``layer_decay ** (last - layer)`` on top, layers from :func:`layer_ids`.
    """
    skip = set(getattr(model, "no_weight_decay", set)())
    layers = layer_ids(model) if layer_decay is not None else {}
    last = max(layers.values(), default=0)
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("offset_conv.weight"):
            kind, decay, scale = "offset", weight_decay, offset_lr_factor
        elif p.ndim <= 1 or name in skip:
            kind, decay, scale = "no_decay", 0.0, 1.0
        else:
            kind, decay, scale = "decay", weight_decay, 1.0
        layer = layers.get(name, last)
        if layer_decay is not None:
            scale *= layer_decay ** (last - layer)
        group = groups.setdefault(
            (layer, kind), {"params": [], "weight_decay": decay, "lr_scale": scale}
        )
        group["params"].append(p)
    if layer_decay is None:  # the two plain groups even when one is empty (as always)
        for kind, decay in (("decay", weight_decay), ("no_decay", 0.0)):
            groups.setdefault((last, kind), {"params": [], "weight_decay": decay, "lr_scale": 1.0})
    order = {"decay": 0, "no_decay": 1, "offset": 2}
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], order[k[1]]))]


def layer_ids(model: nn.Module) -> dict[str, int]:
    """Each parameter's layer for layer-wise decay, from the model's ``group_matcher()`` as
    timm numbers them: the stem 0, then each block (or stage part) in order, the final norm
    with the last block, and what no pattern matches (the head) after all of them."""
    matcher = model.group_matcher(coarse=False)
    compiled = []
    for ordinal, spec in enumerate(matcher.values()):
        for pattern, suffix in spec if isinstance(spec, (list, tuple)) else [(spec, None)]:
            compiled.append((re.compile(pattern), ordinal, suffix))

    def key(name: str) -> tuple[float, ...]:
        for pattern, ordinal, suffix in compiled:
            m = pattern.match(name)
            if m:
                return tuple(float(v) for v in (ordinal, *m.groups(), *(suffix or ())))
        return (math.inf,)

    keys = {name: key(name) for name, _ in model.named_parameters()}
    ids, lid = {}, -1
    for k in sorted(set(keys.values())):
        if lid < 0 or k[-1] != _WITH_PREVIOUS:
            lid += 1
        ids[k] = lid
    return {name: ids[k] for name, k in keys.items()}


_WITH_PREVIOUS = 99999  # a group_matcher suffix: joins the previous layer (timm's final norm)


def fit_older_optimizer_state(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """An optimizer state saved before q/k/v were stored as one ``qkv`` parameter, fitted to
    ``optimizer`` (built on ``model``); any other state is returned as it is.

    A state dict numbers the parameters of each group in the order the group lists them. In an
    older run each fused ``qkv`` was two parameters, ``q`` then ``kv``, in its place in the same
    group (same kind, same layer), so a group of the older run is this one with each ``qkv``
    counted twice. Their per-parameter tensors (``exp_avg``, ``exp_avg_sq``, a momentum) are
    stacked row-wise as the weights are; their step counts are equal and kept.
    """
    parts = unfused_qkv_names(model)
    saved = state.get("param_groups", [])
    if not parts or len(saved) != len(optimizer.param_groups):
        return state
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = [[name_of.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
    older = [sum(2 if n in parts else 1 for n in names) for names in groups]
    if [len(g["params"]) for g in saved] != older or older == [len(n) for n in groups]:
        return state
    old_state, new_state, new_groups, index = state["state"], {}, [], 0
    for names, group in zip(groups, saved, strict=True):
        ids, taken = [], iter(group["params"])
        for n in names:
            olds = [next(taken) for _ in range(2 if n in parts else 1)]
            entries = [old_state.get(i) for i in olds]
            if all(e is not None for e in entries):
                new_state[index] = _stacked(entries) if len(entries) == 2 else entries[0]
            ids.append(index)
            index += 1
        new_groups.append({**group, "params": ids})
    return {"state": new_state, "param_groups": new_groups}


def _stacked(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One parameter's optimizer state from its q and kv parts' (rows stacked)."""
    q, kv = entries
    return {
        k: torch.cat([v, kv[k]]) if isinstance(v, torch.Tensor) and v.ndim > 0 else v
        for k, v in q.items()
    }


class ModelEma:
    """Exponential moving average of the weights (off by default, as in the paper)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module, skip: torch.Tensor | None = None) -> None:
        """Follow the weights; ``skip``: a device flag of a step skipped on the device, which
        leaves the average as it is (as a skipped step on the host does), with no sync."""
        if skip is None:
            for k, v in model.state_dict().items():
                if v.dtype.is_floating_point:
                    self.shadow[k].lerp_(v.detach(), 1 - self.decay)
                else:
                    self.shadow[k].copy_(v)
            return
        weight = torch.where(skip, 0.0, 1 - self.decay)
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].lerp_(v.detach(), weight.to(v.device, self.shadow[k].dtype))
            else:
                self.shadow[k].copy_(torch.where(skip.to(v.device), self.shadow[k], v))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow
