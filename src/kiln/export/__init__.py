"""Turning a run into artifacts that run elsewhere: ``kiln export RUN --format FORMAT --out DIR``.

Formats: ``hf`` (hf.py), ``safetensors`` (weights.py), ``pt2`` (pt2.py: ``torch.export`` and
AOTInductor) and ``onnx`` (onnx.py), the last two optionally ``--quantize int8`` (dynamic) or, for
ONNX, ``int8-static`` (calibrated on validation batches). Weights past ``--max-shard-size``
are split into several safetensors files with an index, as ``transformers`` splits them; a run
saved in shards is exported to ``hf`` or ``safetensors`` one layer at a time (streamed.py).

Every export is checked where it is made: each artifact is loaded back from its files and run on
the run's validation inputs, and ``export.json`` records the largest logit difference from the
PyTorch model; a quantized export also records the task's metric (perplexity or accuracy) and CPU
latency per token against the float model. The directory is written under a temporary name beside
``out`` and renamed when complete, so an interrupted or failed export leaves nothing that looks
whole.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint import checkpoint_step, load_checkpoint
from kiln.checkpoint.store import SHARDED_DIR
from kiln.checkpoint.weights import DEFAULT_MAX_SHARD_SIZE, parse_size
from kiln.config import Config, ConfigError
from kiln.export.check import (
    ExportError,
    Inputs,
    Logits,
    latency_per_token,
    logit_difference,
    task_metric,
    validation_inputs,
)
from kiln.export.hf import write_hf
from kiln.export.streamed import export_streamed
from kiln.export.weights import write_safetensors
from kiln.io import write_atomic
from kiln.train.apply import merge_lora
from kiln.train.run import LoadedRun, find_checkpoint, load_run, saved_job

FORMATS = ("hf", "safetensors", "pt2", "onnx")
QUANTIZE = {"pt2": ("int8",), "onnx": ("int8", "int8-static")}


def export(
    source: str | Path,
    fmt: str,
    out: str | Path,
    *,
    checkpoint: str | Path | None = None,
    quantize: str | None = None,
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    trust: bool = False,
) -> dict[str, Any]:
    """Export a run's checkpoint (the newest by default; ``source`` may also be a checkpoint
    directory) to ``out``; what was written and how it was checked, as a dict (also
    ``out/export.json``). Weights past ``max_shard_size`` are split into several files. A run
    whose config names a plug-in model family is exported only with ``trust`` (see ``saved_job``)."""
    if fmt not in FORMATS:
        raise ConfigError([f"--format: {fmt!r} is not one of {', '.join(FORMATS)}"])
    if quantize and quantize not in QUANTIZE.get(fmt, ()):
        allowed = "; ".join(f"{', '.join(q)} with --format {f}" for f, q in QUANTIZE.items())
        raise ConfigError([f"--quantize: {quantize!r} does not apply to --format {fmt} ({allowed})"])
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError([f"--max-shard-size: {e}"]) from None
    out = Path(out)
    _check_out(Path(source), out, force)
    write = _writer(Path(source), checkpoint, fmt, quantize, shard_bytes, trust)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        info = {
            "format": fmt,
            "quantize": quantize,
            "run": str(write.run_dir.absolute()),
            "checkpoint": str(write.checkpoint.absolute()),
            "step": write.step,
            "task": write.cfg.model.task,
            **write(staging),
        }
        files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
        info.update(files=files, size_bytes=sum(files.values()))
        write_atomic(staging / "export.json", json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


def _check_out(source: Path, out: Path, force: bool) -> None:
    """``out`` may be written: new or empty, or with ``force`` a kiln export (which is replaced
    whole) that is neither ``source`` nor a directory holding it."""
    if out.is_file():
        raise FileExistsError(f"{out}: is a file; --out names a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    if not force:
        raise FileExistsError(f"{out}: exists and is not empty; choose another --out or pass --force")
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise FileExistsError(f"{out}: holds {source}, which is being exported; --force never replaces the source")
    if not (out / "export.json").is_file():
        raise FileExistsError(
            f"{out}: --force replaces only a kiln export (a directory with export.json), and this is not one; "
            "choose another --out"
        )


@dataclasses.dataclass
class _Writer:
    """What an export reads (run, checkpoint, step, config) and the function that writes it into a directory."""

    run_dir: Path
    checkpoint: Path
    step: int
    cfg: Config
    write: Callable[[Path], dict[str, Any]]

    def __call__(self, out: Path) -> dict[str, Any]:
        return self.write(out)


def _writer(
    source: Path, checkpoint: str | Path | None, fmt: str, quantize: str | None, shard_bytes: int, trust: bool
) -> _Writer:
    """A run saved in shards is exported to hf or safetensors without loading it whole
    (``streamed``); every other export loads the model into this process."""
    if fmt in ("hf", "safetensors") and not (source / "export.json").is_file():
        run_dir, path = find_checkpoint(source, checkpoint)
        if (path / SHARDED_DIR).is_dir():
            load_checkpoint(path)  # its manifest's digests checked: nothing half-written is exported
            job = saved_job(run_dir, trust)
            inputs = validation_inputs(job, job.saved_tokenizer(run_dir), run_dir, rows=16)
            return _Writer(
                run_dir,
                path,
                checkpoint_step(path),
                job.cfg,
                lambda out: export_streamed(job, run_dir, path, fmt, out, shard_bytes, inputs),
            )
    run = load_run(source, checkpoint, device="cpu", trust=trust)
    inputs = validation_inputs(run.job, run.tokenizer, run.directory, rows=64 if quantize else 16)
    return _Writer(
        run.directory,
        run.checkpoint,
        run.step,
        run.cfg,
        lambda out: _write_checked(run, fmt, quantize, inputs, out, shard_bytes),
    )


def _write_checked(
    run: LoadedRun, fmt: str, quantize: str | None, inputs: Inputs, out: Path, shard_bytes: int
) -> dict[str, Any]:
    try:
        return _write(run, fmt, quantize, inputs, out, shard_bytes)
    except ImportError as e:  # an optional package of this format is missing
        raise ConfigError([f"--format {fmt}{f' --quantize {quantize}' if quantize else ''}: {e}"]) from None


def _write(
    run: LoadedRun, fmt: str, quantize: str | None, inputs: Inputs, out: Path, shard_bytes: int
) -> dict[str, Any]:
    """Write the format's files into ``out``; the checks of what was written."""
    model = run.model
    # Two batch sizes and two sequence lengths, as the dynamic dimensions promise.
    batches = [inputs.batch(2), inputs.batch(3, max(2, inputs.seq_len // 2))]
    if fmt == "hf":
        return _checks(model, write_hf(run, out, shard_bytes), batches, inputs)
    if fmt == "safetensors":
        return _checks(model, write_safetensors(run, out, shard_bytes), batches, inputs)
    limit = run.family.context_length(run.args)
    name = type(run.family.transformers_model(model) or model).__name__  # what export errors call it
    max_len = limit or 4096
    plain = merge_lora(model, run.family)  # adapters folded in: the exporters see the family's own layers
    if fmt == "pt2":
        from kiln.export.pt2 import PROGRAM, quantize_int8, write_pt2

        if not quantize:
            return _checks(model, write_pt2(plain, batches[0], max_len, out), batches, inputs)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            # The float program and package too, so that each int8 artifact is timed against its own kind.
            floats = write_pt2(plain, batches[0], max_len, Path(tmp))
            written = write_pt2(quantize_int8(plain), batches[0], max_len, out)
            checks = _checks(model, written, batches, inputs, floats)
            return _sizes(checks, Path(tmp) / PROGRAM, out / PROGRAM)
    from kiln.export.onnx import OnnxModel, export_onnx, quantize_onnx_dynamic, quantize_onnx_static

    if not quantize:
        export_onnx(plain, batches[0], out / "model.onnx", limit=limit, name=name)
        return _checks(model, {"onnx": OnnxModel(out / "model.onnx").logits}, batches, inputs)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        fp32 = Path(tmp) / "model.onnx"
        export_onnx(plain, batches[0], fp32, limit=limit, name=name)
        if quantize == "int8":
            quantize_onnx_dynamic(fp32, out / "model.onnx")
        else:  # calibrated on validation rows other than those the metric is measured on
            inputs, calibration = inputs.halves()
            quantize_onnx_static(fp32, out / "model.onnx", [ids.numpy() for ids in calibration])
        floats = {"onnx": OnnxModel(fp32).logits}
        checks = _checks(model, {"onnx": OnnxModel(out / "model.onnx").logits}, batches, inputs, floats)
        return _sizes(checks, fp32, out / "model.onnx")


def _sizes(checks: dict[str, Any], float_file: Path, quantized_file: Path) -> dict[str, Any]:
    """The quantized file's size against the float one's (external data included)."""
    sizes = [sum(p.stat().st_size for p in f.parent.glob(f.name + "*")) for f in (float_file, quantized_file)]
    checks["quantized"].update(float_bytes=sizes[0], bytes=sizes[1], size_ratio=sizes[1] / sizes[0])
    return checks


def _checks(
    model: torch.nn.Module,
    artifacts: dict[str, Logits],
    batches: list,
    inputs: Inputs,
    floats: dict[str, Logits] | None = None,
) -> dict[str, Any]:
    """The logit difference of each artifact from the PyTorch model; for a quantized export, each
    int8 artifact's metric and latency against the float artifact of the same kind."""
    checks: dict[str, Any] = {
        "check": {"inputs": inputs.source, "shapes": [list(b.shape) for b in batches]},
        **{name: logit_difference(model, run, batches) for name, run in artifacts.items()},
    }
    if floats is not None:
        ids = inputs.batch(1)
        checks["quantized"] = {"tokens": ids.size(1), "threads": torch.get_num_threads()}
        for name, quantized in artifacts.items():
            float_latency, latency = latency_per_token(floats[name], ids), latency_per_token(quantized, ids)
            checks["quantized"][name] = {
                "metric": {"float": task_metric(floats[name], inputs), "int8": task_metric(quantized, inputs)},
                "latency_s_per_token": {"float": float_latency, "int8": latency},
                "speedup": float_latency / latency,
            }
    return checks


__all__ = ["FORMATS", "QUANTIZE", "ExportError", "export"]
