"""What a run settles before its first step, once its data is loaded: the config a resume
continues (the saved one, this invocation's explicit keys on top), the training split against
the one the checkpoint trained on (a changed size moves the schedule, said in one line), and
the accumulation window against the epoch's batches. Refusals are one line, before anything
is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lgvit.checkpoints.files import load_checkpoint_pair
from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.errors import LgvitError
from lgvit.run.config import TrainConfig, config_from_dict, config_to_dict, global_batch
from lgvit.run.rundir import check_mid_epoch_batch, check_resume_keys, find_resume, rescale_resume

# Keys of a checkpoint's ``extra``: the training split's size and an epoch's optimizer steps
# when it was saved (a resume compares them with today's data).
TRAIN_IMAGES, EPOCH_STEPS = "train_images", "steps_per_epoch"


def resumed_config(
    cfg: TrainConfig, identity_keys: tuple[str, ...], explicit: Any, out: Path, main: bool,
    world_size: int,
) -> tuple[TrainConfig, Path | None, Any, Any]:  # fmt: skip
    """(config, resume stem, weights, state): the saved run's config with this invocation's
    explicit keys on top when resuming; a run directory that already holds a run is refused
    without --resume."""
    stem = find_resume(cfg.resume, out, [k for k in identity_keys if k in explicit])
    if stem is None and RunLayout(out).last_weights.exists():
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


def data_change_note(
    state: dict[str, Any], cfg: TrainConfig, images: int | None, spe: int, stem: Path
) -> str | None:
    """A resume whose training split has another size than the checkpoint's (None: the same,
    or either unknown): one line saying so and what it does to the schedule. An epochs run's
    schedule position (``state["global_step"]``, changed here) moves to the same epoch counted
    in today's steps; an iteration budget keeps its steps. Inside an epoch it is refused: the
    saved position counts batches of the other split."""
    extra = state.get("extra") or {}
    was, was_spe = extra.get(TRAIN_IMAGES), extra.get(EPOCH_STEPS)
    if images is None or not isinstance(was, int) or was == images:
        return None
    epoch, step = state["epoch"], state["global_step"]
    if extra.get("mid_epoch") is not None:
        raise LgvitError(
            f"--resume {stem}: saved inside epoch {epoch + 1} of a training split of {was} "
            f"images, which now has {images}; its place in the epoch counts batches of the "
            "other split: restore the data, or start a new run from its weights"
        )
    head = (f"{stem}: the training split has {images} images, not {was} as when it was saved "
            f"({spe} steps an epoch" + (f", not {was_spe}" if was_spe else "") + ")")  # fmt: skip
    if cfg.iters:
        left = max(cfg.iters - step, 0)
        if not left:
            return f"{head}; the run's budget of {cfg.iters} steps is spent: it is finished"
        return (f"{head}; the budget of {cfg.iters} steps continues at step {step}: {left} more, "
                f"in {-(-left // spe)} epoch(s)")  # fmt: skip
    if epoch + 1 >= cfg.epochs:
        return f"{head}; all {cfg.epochs} epochs are done: the run is finished"
    state["global_step"] = (epoch + 1) * spe
    return (f"{head}; the lr schedule continues after epoch {epoch + 1} at step "
            f"{state['global_step']} of {cfg.epochs * spe} (was {step})")  # fmt: skip


def resume_notes(
    state: dict[str, Any], cfg: TrainConfig, images: int | None, spe: int, world_size: int,
    stem: Path,
) -> list[str | None]:  # fmt: skip
    """What a resume changes in the saved schedule, a line each: another global batch
    (:func:`~lgvit.run.rundir.rescale_resume`), another size of the training split."""
    return [rescale_resume(state, cfg, spe, world_size),
            data_change_note(state, cfg, images, spe, stem)]  # fmt: skip
