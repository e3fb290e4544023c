"""What a run settles before its first step: the config a resume continues (the saved one,
this invocation's explicit keys on top) and, once its data is loaded, the accumulation window
against the epoch's batches. Refusals are one line, before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lgvit.checkpoints.files import checkpoint_paths, load_checkpoint_pair
from lgvit.core.errors import LgvitError
from lgvit.run.config import TrainConfig, config_from_dict, config_to_dict, global_batch
from lgvit.run.rundir import check_mid_epoch_batch, check_resume_keys, find_resume


def resumed_config(
    cfg: TrainConfig, identity_keys: tuple[str, ...], explicit: Any, out: Path, main: bool,
    world_size: int,
) -> tuple[TrainConfig, Path | None, Any, Any]:  # fmt: skip
    """(config, resume stem, weights, state): the saved run's config with this invocation's
    explicit keys on top when resuming; a run directory that already holds a run is refused
    without --resume."""
    stem = find_resume(cfg.resume, out, [k for k in identity_keys if k in explicit])
    if stem is None and checkpoint_paths(out / "last")[0].exists():
        raise LgvitError(
            f"{out} already holds a run; pass --resume auto to continue it, or another --out"
        )
    if stem is None:
        return cfg, None, None, None
    if "initial_checkpoint" in explicit and cfg.initial_checkpoint:
        raise LgvitError("--initial-checkpoint starts a new run; a resumed run continues from "
                         f"its own weights in {stem} (drop one of the two)")  # fmt: skip
    weights, state = load_checkpoint_pair(stem, repair=main)
    saved = config_from_dict(state["config"], source=f"{stem}")
    check_resume_keys(saved, cfg, explicit, stem, identity_keys)
    asked = {k: getattr(cfg, k) for k in ("batch_size", "grad_accum_steps") if k in explicit}
    check_mid_epoch_batch(state, asked.get("batch_size"), stem, world_size,
                          asked.get("grad_accum_steps"))  # fmt: skip
    now = config_to_dict(cfg)
    keep = {k: now[k] for k in {"out", "resume", *explicit} - {"initial_checkpoint"}}
    return (
        config_from_dict({**config_to_dict(saved), **keep}, source="resume"),
        stem,
        weights,
        state,
    )


def check_accum_window(cfg: TrainConfig, batches: int, world_size: int, explicit: Any) -> None:
    """A window of more micro-batches than the epoch has steps once an epoch, on the epoch's
    batches, with the lr scaled for a global batch it never has: refused, with the largest
    window that fits."""
    accum = cfg.grad_accum_steps
    if accum <= batches:
        return
    what = (f"--grad-accum-steps {accum}" if "grad_accum_steps" in explicit
            else f"grad_accum_steps={accum} (the run's config)")  # fmt: skip
    raise LgvitError(
        f"{what}: a window longer than the epoch's {batches} batch(es) of {cfg.batch_size} x "
        f"{world_size} process(es); it would step once an epoch with the lr scaled for a global "
        f"batch of {global_batch(cfg, world_size)}; use at most --grad-accum-steps {batches}"
    )
