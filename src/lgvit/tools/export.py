"""``lgvit export``: a model out of PyTorch — ONNX, a ``torch.export`` program (``.pt2``) or the
Hugging Face hub layout — with its preprocessing in the file and a parity check against eager.

ONNX goes through ``torch.onnx.export(dynamo=True)`` (needs ``onnx`` and ``onnxscript``; the
check runs the file in ``onnxruntime``): ``pip install 'lgvit[export]'``. The metadata (model
name, input size, mean/std, crop, interpolation, class names) is written into the ONNX file's
``metadata_props`` and into the ``.pt2`` archive as ``extra/lgvit.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lgvit.checkpoints.run_layout import WEIGHTS_SUFFIX
from lgvit.core.atomic import check_writable, naming
from lgvit.core.errors import LgvitError, error_lines

FORMATS = ("onnx", "pt2", "hf")
TOLERANCE = 1e-4  # max abs logit difference accepted by --check (fp32 reorderings: ~1e-6)
SUFFIXES = {"onnx": ".onnx", "pt2": ".pt2", "hf": ""}  # each format's file suffix ("": a folder)


def load_source(
    source: str, img_size: int | None = None, model_name: str | None = None
) -> tuple[nn.Module, bool]:
    """``(eval-mode CPU model, has_trained_weights)`` from a registered name (random weights),
    ``local-dir:``/``hf-hub:``, or a checkpoint (``runs/x/best``, ``.safetensors``, or a
    ``.pth`` state dict such as the authors' releases, with ``model_name``)."""
    from lgvit.checkpoints.files import is_size
    from lgvit.inference import load_model
    from lgvit.models import create_model, is_model
    from lgvit.models.hub import FOLDER_PREFIXES

    if img_size is not None and not is_size(img_size):
        raise LgvitError(f"--img-size {img_size}: must be a whole number >= 1")
    if is_model(source):  # random weights: no checkpoint to load
        try:
            kwargs = {"img_size": img_size} if img_size else {}
            return create_model(source, **kwargs).eval(), False
        except ValueError as e:
            raise LgvitError(f"{source}: {e}") from None
    near = (source + s for s in ("", WEIGHTS_SUFFIX, ".pt", ".pth"))
    if (
        not source.startswith(FOLDER_PREFIXES)
        and os.sep not in source
        and not any(Path(f).exists() for f in near)
    ):
        raise LgvitError(f"{source!r} is neither a registered model nor a checkpoint path")
    return load_model(source, "cpu", model_name, img_size=img_size), True


def metadata(model: nn.Module) -> dict[str, str]:
    cfg = model.pretrained_cfg
    meta = {
        "lgvit_model": getattr(model, "model_name", ""),
        "input_size": json.dumps(list(cfg["input_size"])),
        "mean": json.dumps(list(cfg["mean"])),
        "std": json.dumps(list(cfg["std"])),
        "crop_pct": str(cfg.get("crop_pct")),
        "interpolation": str(cfg.get("interpolation")),
        "num_classes": str(getattr(model, "num_classes", "")),
    }
    if cfg.get("label_names"):
        meta["label_names"] = json.dumps(cfg["label_names"])
    return meta


def _need(*modules: str) -> None:
    missing = []
    for m in modules:
        try:
            __import__(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise LgvitError(
            f"ONNX export needs {', '.join(missing)}, which is not installed: "
            "pip install 'lgvit[export]'"
        )


def _dynamic_shapes(dynamic_batch: bool, dynamic_size: bool) -> Any:
    if not (dynamic_batch or dynamic_size):
        return None
    dims: dict[int, Any] = {}
    if dynamic_batch:
        dims[0] = torch.export.Dim("batch", min=1, max=4096)
    if dynamic_size:
        dims[2] = dims[3] = torch.export.Dim.DYNAMIC  # an error if the model fixes them
    return ({**dims},)


@contextlib.contextmanager
def _quiet():
    """The exporters print progress lines and log warnings (missing torchvision ops): hide
    them; errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _native_stderr_hidden():
    """onnxruntime logs a failed run from C++ straight to file descriptor 2; the failure
    reaches the user as one line anyway."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _useful_line(e: BaseException) -> str:
    """The line of an exporter's error that says what failed (they run to pages: suggested
    fixes, "- " bullet lists), else its first line; at most 240 characters."""
    lines = [ln for ln in error_lines(e) if not ln.startswith("-")]
    keys = ("Constraints violated", "Cannot", "Error:", "not supported", "unhashable")
    useful = [ln for ln in lines if any(k in ln for k in keys)]
    return (useful or lines or [type(e).__name__])[0][:240]


def opset_range() -> tuple[int, int]:
    """The ONNX opsets ``--opset`` may ask for: torch's exporter's range, capped at what the
    installed ``onnx`` knows. (The exporter builds at its own opset and converts; a conversion
    it cannot do is caught after the export.)"""
    try:
        from torch.onnx import _constants

        low, high = _constants.ONNX_MIN_OPSET, _constants.ONNX_MAX_OPSET
    except (ImportError, AttributeError):
        low, high = 7, 23
    with contextlib.suppress(ImportError):
        import onnx

        high = min(high, onnx.defs.onnx_opset_version())
    return low, high


def _check_opset(opset: int | None, fmt: str) -> None:
    if opset is None:
        return
    if fmt != "onnx":
        raise LgvitError(f"--opset {opset}: an ONNX opset, for --format onnx only (not {fmt})")
    low, high = opset_range()
    if isinstance(opset, bool) or not isinstance(opset, int) or not low <= opset <= high:
        raise LgvitError(f"--opset {opset}: torch's ONNX exporter writes opsets {low} to {high}")


def write(
    model: nn.Module,
    fmt: str,
    out: Path,
    dynamic_batch: bool = False,
    dynamic_size: bool = False,
    opset: int | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Export ``model`` to ``out``; returns a function running the exported file. A failed
    export, or a file that does not load or run as asked, leaves no ``out`` behind."""
    _check_opset(opset, fmt)
    name = getattr(model, "model_name", type(model).__name__)
    size = tuple(model.pretrained_cfg["input_size"])
    example = torch.randn(2 if dynamic_batch else 1, *size)
    shapes = _dynamic_shapes(dynamic_batch, dynamic_size)
    reasons = [getattr(m, "fixed_grid_reason", None) for m in model.modules()]
    if dynamic_size and any(reasons) and fmt != "hf":
        why = next(r for r in reasons if r)
        raise LgvitError(f"{name} cannot be exported with a dynamic height/width: {why}")
    if dynamic_size and hasattr(model, "dynamic_img_size"):
        model.dynamic_img_size = True  # position embeddings resized inside the graph
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        from lgvit.models import create_model

        model.save_pretrained(out)
        loaded = create_model(f"local-dir:{out}").eval()
        return lambda x: loaded(x)
    try:
        _export_file(model, fmt, out, example, shapes, opset)
        run = _runner(model, fmt, out, opset)
    except BaseException as e:
        out.unlink(missing_ok=True)  # a partial or invalid file is no export
        if isinstance(e, LgvitError | OSError) or not isinstance(e, Exception):
            raise  # an OSError is the file's (a full disk), not the model's
        what = "with a dynamic height/width" if dynamic_size else f"to {fmt}"
        raise LgvitError(f"{name} cannot be exported {what}: {_useful_line(e)}") from None
    if dynamic_size:  # the exporters may keep the size symbolic yet fix the token grid
        probe = torch.randn(1, size[0], 2 * size[1], 2 * size[2])
        try:
            with torch.inference_mode(), _native_stderr_hidden():
                run(probe)
        except Exception as e:  # noqa: BLE001
            out.unlink(missing_ok=True)
            raise LgvitError(
                f"{name} cannot be exported with a dynamic height/width: the exported graph "
                f"fixes its token grid ({_useful_line(e)})"
            ) from None
    return run


def _export_file(
    model: nn.Module, fmt: str, out: Path, example: torch.Tensor, shapes: Any, opset: int | None
) -> None:
    with _quiet(), warnings.catch_warnings():
        # Mask / index caches filled while tracing are plain attributes by design.
        warnings.filterwarnings("ignore", message=".*were assigned during export")
        if fmt == "pt2":
            program = torch.export.export(model, (example,), dynamic_shapes=shapes)
            torch.export.save(
                program, str(out), extra_files={"lgvit.json": json.dumps(metadata(model))}
            )
        else:
            _need("onnx", "onnxscript")
            kwargs = {"opset_version": opset} if opset else {}
            torch.onnx.export(
                model, (example,), str(out), dynamo=True, dynamic_shapes=shapes,
                input_names=["image"], output_names=["logits"], external_data=False, **kwargs,
            )  # fmt: skip


def _onnx_opset(proto: Any) -> int | None:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def _runner(
    model: nn.Module, fmt: str, out: Path, opset: int | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    if fmt == "pt2":
        program = torch.export.load(str(out))
        module = program.module()
        return lambda x: module(x)
    import onnx

    proto = onnx.load(str(out))
    if opset is not None and _onnx_opset(proto) != opset:  # the exporter falls back silently
        raise LgvitError(
            f"--opset {opset}: torch's exporter could not convert "
            f"{getattr(model, 'model_name', 'the model')} to opset {opset} (it wrote opset "
            f"{_onnx_opset(proto)}); ask for another"
        )
    for key, value in metadata(model).items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(out))
    _need("onnxruntime")
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # errors reach the user as one line, not a C++ log
    try:
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 -- e.g. an opset newer than onnxruntime runs
        raise LgvitError(f"onnxruntime cannot load the exported model: {_useful_line(e)}") from None
    quiet = ort.RunOptions()
    quiet.log_severity_level = 3
    return lambda x: torch.from_numpy(session.run(None, {"image": x.numpy()}, quiet)[0])


def _median_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    from lgvit.tools.measure import time_fn

    return 1000 * time_fn(fn, warmup=1, repeats=repeats)


def check(
    model: nn.Module,
    run: Callable[[torch.Tensor], torch.Tensor],
    batches: Sequence[torch.Tensor],
) -> list[dict[str, Any]]:
    """Max abs difference to eager and the latency of both, per input batch."""
    rows = []
    for x in batches:
        with torch.inference_mode():
            ref = model(x)
            got = run(x)
            rows.append(
                dict(
                    batch=x.shape[0],
                    size=tuple(x.shape[-2:]),
                    max_abs_diff=float((got - ref).abs().max()),
                    eager_ms=_median_ms(lambda x=x: model(x)),
                    exported_ms=_median_ms(lambda x=x: run(x)),
                )
            )
    return rows


def export(
    source: str,
    fmt: str,
    out: str | None = None,
    img_size: int | None = None,
    dynamic_batch: bool = False,
    dynamic_size: bool = False,
    opset: int | None = None,
    run_check: bool = True,
    images: Sequence[str] = (),
    log: Callable[[str], None] = print,
    model_name: str | None = None,
) -> dict[str, Any]:
    """Export ``source`` and (``run_check``) compare the file with eager; returns a report.
    ``model_name``: the architecture of a ``.pth`` state dict (the authors' releases)."""
    if fmt not in FORMATS:
        raise LgvitError(f"--format {fmt!r}: choose onnx, pt2 or hf")
    if fmt == "onnx":
        _need("onnx", "onnxscript", "onnxruntime")
    _check_opset(opset, fmt)
    if out:
        check_out(Path(out), fmt)
    model, trained = load_source(source, img_size, model_name)
    name = model.model_name
    if not trained:
        warnings.warn(f"{name} has random weights (pass a checkpoint to export one)", stacklevel=2)
    path = Path(out) if out else check_out(Path(f"{name}{SUFFIXES[fmt]}"), fmt)
    checks = (dynamic_batch, dynamic_size, run_check, images)
    if fmt == "hf":  # a folder, written in place
        run = write(model, fmt, path, dynamic_batch, dynamic_size, opset)
        report = _checked(model, run, path, fmt, *checks)
    else:  # a file: renamed into place once it passed every check (a failed one leaves none)
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        try:
            with naming(tmp, path):
                run = write(model, fmt, tmp, dynamic_batch, dynamic_size, opset)
                report = _checked(model, run, path, fmt, *checks)
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    log(f"wrote {path}")
    for r in report["checks"]:
        log(
            f"  batch {r['batch']} at {r['size'][0]}x{r['size'][1]}: max abs diff "
            f"{r['max_abs_diff']:.2e}; eager {r['eager_ms']:.1f} ms, "
            f"{fmt} {r['exported_ms']:.1f} ms"
        )
    return report


def check_out(path: Path, fmt: str) -> Path:
    """Before any work: ``path`` is where ``fmt`` can be written (a file under the format's
    suffix, which ``file_metadata`` reads the format from; a folder for ``hf``)."""
    suffix = SUFFIXES[fmt]
    check_writable(path, "--out", folder=not suffix)
    if suffix and path.suffix != suffix:
        raise LgvitError(f"--out {path}: --format {fmt} writes a {suffix} file; name it "
                         f"{path.with_suffix(suffix).name}")  # fmt: skip
    if not suffix and path.suffix and path.suffix in SUFFIXES.values():
        raise LgvitError(f"--out {path}: --format {fmt} writes a folder, not a {path.suffix} "
                         f"file; use --format {path.suffix[1:]} for that")  # fmt: skip
    return path


def _checked(
    model: nn.Module,
    run: Callable[[torch.Tensor], torch.Tensor],
    path: Path,
    fmt: str,
    dynamic_batch: bool,
    dynamic_size: bool,
    run_check: bool,
    images: Sequence[str],
) -> dict[str, Any]:
    """The report of an export: (``run_check``) its outputs against eager's, per batch; an
    error when they differ by more than ``TOLERANCE``."""
    report: dict[str, Any] = {
        "model": model.model_name, "format": fmt, "file": str(path), "checks": [],
    }  # fmt: skip
    if not run_check:
        return report
    size = tuple(model.pretrained_cfg["input_size"])
    torch.manual_seed(0)
    if images:
        from lgvit.inference import preprocess_images

        real = preprocess_images(model, images)
        batches = [real[:1]] + ([real] if dynamic_batch and len(real) > 1 else [])
    else:
        batches = [torch.randn(1, *size)] + ([torch.randn(4, *size)] if dynamic_batch else [])
    if dynamic_size:
        big = (size[0], size[1] * 2, size[2] * 2)
        batches.append(torch.randn(batches[-1].shape[0], *big))
    try:
        rows = check(model, run, batches)
    except Exception as e:  # noqa: BLE001 -- e.g. the exported file refusing a shape
        raise LgvitError(f"{path}: the exported model failed to run: {_useful_line(e)}") from None
    report["checks"] = rows
    worst = max(r["max_abs_diff"] for r in rows)
    if not worst <= TOLERANCE:
        raise LgvitError(
            f"{path}: exported outputs differ from eager by {worst:.2e} (> {TOLERANCE:g})"
            + ("; nothing written" if fmt != "hf" else "")
        )
    return report


def file_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The preprocessing metadata stored in an exported ``.onnx`` or ``.pt2`` file."""
    p = Path(path)
    if p.suffix == ".onnx":
        import onnx

        return {m.key: m.value for m in onnx.load(str(p), load_external_data=False).metadata_props}
    extra = {"lgvit.json": ""}
    torch.export.load(str(p), extra_files=extra)
    return json.loads(extra["lgvit.json"])
