"""A run's curves in TensorBoard and Weights & Biases (``log_to: [tensorboard, wandb]``).

``metrics.jsonl`` stays the run's record (``lgvit plot`` reads it); these loggers mirror it for
the tools research groups watch runs in: every ``log_every`` optimizer steps the training loss,
learning rate and images per second, and after every epoch each number of the epoch's metrics
(its evaluation's, the training size...), all against the global optimizer step; the resolved
config as text (TensorBoard) or the run's config (W&B). Only rank 0 logs. A resumed run
continues its own curves: TensorBoard's writer drops what the killed run logged after the
checkpoint (``purge_step``) and goes on from its step; W&B continues the same run (its id is
kept in ``<out>/wandb_id``; W&B cannot rewind, so steps a killed run logged past its last
checkpoint keep their first values there).
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.atomic import atomic_write_bytes
from lgvit.core.errors import LgvitError, first_line

LOGGERS = ("tensorboard", "wandb")  # the values log_to takes


def check_loggers(names: Sequence[str], out: Path | None = None) -> None:
    """Each logger can start: its package is installed (one line naming the extra otherwise),
    W&B has credentials or runs offline, and ``<out>/tensorboard`` can be written (when ``out``
    is given). Checked when the run starts, before it writes anything, not at its first log
    line."""
    for name in names:
        module = "torch.utils.tensorboard" if name == "tensorboard" else "wandb"
        try:
            __import__(module)
        except ImportError:
            package = "tensorboard" if name == "tensorboard" else "wandb"
            raise LgvitError(
                f"log_to {name} needs the {package} package: pip install 'lgvit[{package}]'"
            ) from None
    if "tensorboard" in names and out is not None:
        _check_tensorboard_dir(RunLayout(out).tensorboard)
    if "wandb" in names:
        _check_wandb_login()


def _check_tensorboard_dir(folder: Path) -> None:
    """TensorBoard's writer makes its folder and writes its event file on a thread of its own:
    a folder it cannot write is a traceback from that thread, interleaved with the run's error
    line. Checked here instead, without creating anything."""
    if folder.exists() and not folder.is_dir():
        raise LgvitError(f"log_to tensorboard: {folder} is not a folder (a file is there); move "
                         "it away, or use another --out")  # fmt: skip
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise LgvitError(f"log_to tensorboard: {folder} cannot be created ({existing} is a "
                         "file)")  # fmt: skip
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "" if existing == folder else f": {existing} is not writable"
        verb = "write in" if existing == folder else "create"
        raise LgvitError(f"log_to tensorboard: cannot {verb} {folder}{why} (permission denied)")


def _check_wandb_login() -> None:
    """W&B online without credentials: ``wandb.init`` raises its UsageError (a traceback) once
    the run has started. Its own resolution, without the network: the mode from the
    environment and settings files, then the key from WANDB_API_KEY, an identity token,
    ``~/.netrc`` or its settings (nothing is verified against the server)."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate
    except ImportError:  # a wandb of another layout: wandb.init says it in its own words
        return
    try:
        settings = wandb_setup.singleton().settings
        if settings.mode in ("offline", "dryrun", "disabled"):
            return
        auth = authenticate.authenticate_session(
            host=settings.base_url, source="lgvit", prompt=False, update_session=False
        )
    except Exception as e:  # noqa: BLE001 -- a malformed key or settings file: one line
        raise LgvitError(f"log_to wandb: {type(e).__name__}: {first_line(e)}") from None
    if auth is None:
        raise LgvitError(
            "log_to wandb: no W&B credentials (WANDB_API_KEY, ~/.netrc): log in with `wandb "
            "login` or set WANDB_API_KEY, or log offline with WANDB_MODE=offline (`wandb sync` "
            "uploads the run later)"
        )


class RunLoggers:
    """The run's loggers (none unless ``names``); a no-op on ranks other than 0."""

    def __init__(
        self,
        names: Sequence[str],
        out: Path,
        main: bool,
        config: Mapping[str, Any],
        config_text: str,
        start_step: int | None = None,
        project: str | None = None,
    ) -> None:
        """``start_step``: the step a resumed run continues from (None: a fresh run)."""
        self.tb: Any = None
        self.wandb: Any = None
        if not main or not names:
            return
        check_loggers(names)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            purge = start_step + 1 if start_step is not None else None
            self.tb = SummaryWriter(str(RunLayout(out).tensorboard), purge_step=purge)
            if start_step is None:
                self.tb.add_text("config", "```\n" + config_text + "\n```", 0)
        if "wandb" in names:
            self.wandb = _wandb_run(out, config, project, fresh=start_step is None)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Log the finite numbers of ``values`` at global step ``step``."""
        numbers = {k: float(v) for k, v in values.items() if _number(v)}
        if not numbers:
            return
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def epoch_scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """An epoch's metrics row as logger keys: ``train/loss``, ``test/acc1``, ``epoch``..."""
    out = {}
    for k, v in metrics.items():
        if k.startswith("test_"):
            out[f"test/{k[5:]}"] = v
        elif k.startswith("train_"):
            out[f"train/{k[6:]}"] = v
        else:
            out[k if k == "epoch" else f"epoch/{k}"] = v
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _wandb_run(out: Path, config: Mapping[str, Any], project: str | None, fresh: bool) -> Any:
    """A W&B run for ``out``: a new one for a fresh run, its own again for a resumed one."""
    import wandb

    id_file = RunLayout(out).wandb_id
    run_id = None if fresh or not id_file.is_file() else id_file.read_text().strip()
    run_id = run_id or secrets.token_hex(4)  # W&B's own ids are 8 characters too
    atomic_write_bytes(id_file, run_id.encode())
    return wandb.init(project=project or "lgvit", name=out.name, id=run_id, resume="allow",
                      dir=str(out), config=dict(config))  # fmt: skip
