"""One logger, four sinks: console line, ``metrics.jsonl``, TensorBoard event files and, when
asked for, Weights & Biases.

The training loop hands over plain floats at log intervals only; turning device tensors into
floats (a host sync) is the loop's business and happens once per interval.
"""

from __future__ import annotations

import html
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kiln.config import Config, ConfigError
from kiln.io import write_atomic
from kiln.observe.progress import ProgressBar

METRICS_FILE = "metrics.jsonl"
# The W&B run id of this run directory, so that a resumed run continues the same W&B run.
WANDB_ID_FILE = "wandb_id.txt"
# Logged to the files, left off the console line to keep it short.
CONSOLE_HIDDEN = {"memory/peak_reserved_gib", "global_batch", "micro_batch_size", "tokens", "moe/min_load"}
# Per-class figures of a classifier: in the files, too many for the console line.
CONSOLE_HIDDEN_PREFIXES = ("val_precision/", "val_recall/", "val_f1/")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _fmt(key: str, value: float) -> str:
    if key in ("lr",):
        return f"lr {value:.2e}"
    if key.endswith("tokens_per_s"):
        return f"{value / 1e3:.1f}k tok/s" if value >= 1e3 else f"{value:.0f} tok/s"
    if key == "mfu":
        return f"MFU {100 * value:.1f}%"
    if key == "elapsed_s":
        return f"elapsed {format_duration(value)}"
    if key == "grad_norm":
        return f"gnorm {value:.3f}"
    if key in ("memory/peak_allocated_gib", "memory/rss_gib"):
        return f"{'mem' if 'peak' in key else 'rss'} {value:.2f} GiB"
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


def _wandb_run_id(run_dir: Path) -> str:
    path = run_dir / WANDB_ID_FILE
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:16]  # W&B ids are lowercase letters and digits
    write_atomic(path, run_id + "\n")
    return run_id


def _start_wandb(run_dir: Path, project: str, config: dict[str, Any] | None):
    try:
        import wandb
    except ImportError:
        # A ConfigError: the CLI reports it as one line naming the key, not a traceback.
        raise ConfigError(
            [
                "observe.wandb: needs the wandb package, which is not installed: "
                "pip install wandb (or pip install 'kiln[wandb]'), or set observe.wandb=false"
            ]
        ) from None
    return wandb.init(
        project=project, dir=str(run_dir), name=run_dir.name, config=config, id=_wandb_run_id(run_dir), resume="allow"
    )


def _histogram_values(tensor: torch.Tensor) -> torch.Tensor:
    """The finite values of a parameter or gradient, flat, in float32 on the host. A DTensor
    (FSDP, tensor parallel) gives its local shard: only rank 0 logs, so gathering the full
    tensor, a collective every rank must join, would hang the others."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    # To the host before widening to float32: no extra copy on the device, where memory is
    # tightest while the gradients are still held. ``to`` a dtype also dequantizes a quantized
    # weight (a QLoRA base), where ``float()`` may keep it as it is.
    values = tensor.detach().cpu().to(torch.float32).flatten()
    # Histogram bins come from the value range, which a NaN or inf makes meaningless.
    return values[torch.isfinite(values)]


def _tensorboard_scalars(values: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """A record's (tag, value) pairs for TensorBoard's scalars. A dict of lists of numbers
    (``moe/load``: {layer: each expert's share}) has no TensorBoard view of its own: each number
    becomes a scalar, ``KEY/NAME/INDEX``, to follow over the steps like any other."""
    for key, value in values.items():
        if isinstance(value, dict):
            for name, row in value.items():
                if isinstance(row, list):
                    yield from ((f"{key}/{name}/{i}", v) for i, v in enumerate(row))
        else:
            yield key, value


class _Histograms:
    """When weight and gradient histograms are due (observe.histograms_every; 0: never)."""

    histograms_every = 0

    def inspector(self, step: int) -> Callable[[torch.nn.Module], None] | None:
        """What looks at the model before (1-based) ``step``'s update, its gradients in place: its
        histograms when due, else None."""
        if not self.histograms_every or step % self.histograms_every:
            return None
        return lambda model: self.histograms(step, model)

    def histograms(self, step: int, model: torch.nn.Module) -> None:
        raise NotImplementedError


class MetricsLogger(_Histograms):
    """Writes each logged step to every sink. ``start_step`` > 0 means a resumed run: records
    of later steps (written before the interruption, and about to be redone) are dropped so
    the history stays one line per step. With ``wandb_project`` the records also go to that
    Weights & Biases project, as one W&B run per run directory (resumed runs continue it);
    ``config`` is the run's configuration shown there."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        console: bool = True,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: dict[str, Any] | None = None,
        histograms_every: int = 0,
    ):
        self.run_dir, self.histograms_every = Path(run_dir), histograms_every
        # First: when wandb is missing, fail before any file is opened.
        self._wandb = _start_wandb(self.run_dir, wandb_project, config) if wandb_project else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        # A live bar where a person watches; the plain line log where output goes to a file.
        self._bar = ProgressBar(total_steps, start_step) if console and sys.stdout.isatty() else None
        self.total_steps = total_steps
        self.path = self.run_dir / METRICS_FILE
        self._truncate_after(start_step)
        # Held open for the logger's lifetime (line-buffered appends); closed in close().
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step or None)
        # The ETA's clock: from the end of the loop's first step (set then), so that the setup
        # before it (a time plan's probe, loading, compiling) does not count as a step's pace;
        # and the last line's step and time (a compile after some steps slows the average).
        self._start_step = start_step
        self._t0: float | None = None
        self._last_line: tuple[int, float] | None = None

    @property
    def total_steps(self) -> int:
        return self._total_steps

    @total_steps.setter
    def total_steps(self, steps: int) -> None:
        """Known late when max_steps is planned from the time budget."""
        self._total_steps = steps
        if self._bar is not None:
            self._bar.set_total(steps)

    def step_done(self, step: int) -> None:
        """Every step, for the progress bar and the ETA's clock: host-side, no sync."""
        if self._t0 is None:
            self._t0, self._start_step = time.perf_counter(), step
        if self._bar is not None:
            self._bar.advance(step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept, torn = [], []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:  # a line cut short: the run was killed while writing it, or the disk was full
                torn.append(number)
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        if torn:
            which = f"line {torn[0]}" if len(torn) == 1 else f"lines {', '.join(map(str, torn))}"
            print(
                f"kiln: warning: {self.path}: {which} cut short (a kill while writing, or a full disk): dropped",
                file=sys.stderr,
            )
        write_atomic(self.path, "".join(line + "\n" for line in kept))

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a rollback): drop what was logged after it, so the
        redone steps are not recorded twice. (W&B keeps its history: its steps only go up.)"""
        self._file.close()
        self._truncate_after(step)
        # Reopened and held open, as in __init__.
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=step + 1)

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in _tensorboard_scalars(values):
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(values), step=step)
        if self.console:
            print(self._console_line(step, values), flush=True)
        if self._bar is not None:
            self._bar.show(values)

    def _console_line(self, step: int, values: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        parts += [
            _fmt(k, v)
            for k, v in values.items()
            if k not in CONSOLE_HIDDEN
            and not k.startswith(CONSOLE_HIDDEN_PREFIXES)
            and isinstance(v, (int, float))
            and (k != "skipped_steps" or v)
        ]
        done = step - self._start_step
        if self._t0 is not None and done > 0 and step < self.total_steps and "val_loss" not in values:
            now = time.perf_counter()
            pace = (now - self._t0) / done
            if self._last_line is not None and step > self._last_line[0]:
                # The faster of the run's average pace and the last interval's.
                pace = min(pace, (now - self._last_line[1]) / (step - self._last_line[0]))
            self._last_line = step, now
            parts.append(f"ETA {format_duration(pace * (self.total_steps - step))}")
        return " | ".join(parts)

    def event(self, step: int, kind: str, message: str, **details: Any) -> None:
        """Something the run did by itself (e.g. a smaller micro-batch after running out of
        memory): a line in metrics.jsonl with an "event" key, TensorBoard text, the console."""
        self._file.write(json.dumps({"step": step, "event": kind, "message": message, **details}) + "\n")
        if self._tb is not None:
            self._tb.add_text(f"events/{kind}", message, step)
        if self._wandb is not None:
            self._wandb.log({f"events/{kind}": message}, step=step)
        if self.console:
            print(f"kiln: {message}", flush=True)

    def text(self, step: int, tag: str, text: str) -> None:
        """A text record (e.g. a generated sample): console, TensorBoard, and ``samples.txt``."""
        with open(self.run_dir / "samples.txt", "a") as f:
            f.write(f"--- step {step} ({tag}) ---\n{text}\n")
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self._wandb is not None:
            import wandb

            # <pre> keeps a sample's indentation and line breaks as generated.
            self._wandb.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)
        if self.console:
            print(f"--- {tag} at step {step} ---\n{text}\n---", flush=True)

    def histograms(self, step: int, model: torch.nn.Module) -> None:
        """Each parameter's weights (``weights/NAME``) and, where it has one, gradient
        (``grads/NAME``) as a histogram, to TensorBoard and W&B. Call it after the backward
        pass and before ``zero_grad``, or there are no gradients to show."""
        if self._tb is None and self._wandb is None:
            return  # nowhere to show them: skip copying every parameter to the host
        tensors = {}
        for name, param in model.named_parameters():
            tensors[f"weights/{name}"] = _histogram_values(param)
            if param.grad is not None:
                tensors[f"grads/{name}"] = _histogram_values(param.grad)
        tensors = {tag: values for tag, values in tensors.items() if values.numel()}
        if self._tb is not None:
            for tag, values in tensors.items():
                self._tb.add_histogram(tag, values, step)
        if self._wandb is not None:
            import wandb

            # wandb annotates a Sequence, but hands it to np.histogram, which takes an array as it is.
            histograms = {tag: wandb.Histogram(values.numpy()) for tag, values in tensors.items()}  # type: ignore[arg-type]
            self._wandb.log(histograms, step=step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullLogger(_Histograms):
    """The logger of ranks other than 0: takes every record and writes nothing (its histograms
    are due when the main rank's are, as they may gather what they show)."""

    total_steps: int  # set by the loop as on a MetricsLogger, read by nothing

    def __init__(self, histograms_every: int = 0):
        self.histograms_every = histograms_every

    def log(self, step: int, values: dict[str, Any]) -> None:
        pass

    def text(self, step: int, tag: str, text: str) -> None:
        pass

    def event(self, step: int, kind: str, message: str, **details: Any) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass

    def histograms(self, step: int, model: torch.nn.Module) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc) -> None:
        pass


def open_logger(
    run_dir: str | Path, cfg: Config, *, main: bool, total_steps: int, start_step: int, console: bool
) -> MetricsLogger | NullLogger:
    """The logger of a run of ``cfg`` on its main rank (``main``), a ``NullLogger`` on the others."""
    observe = cfg.observe
    if not main:
        return NullLogger(observe.histograms_every)
    return MetricsLogger(
        run_dir,
        total_steps=total_steps,
        start_step=start_step,
        console=console,
        wandb_project=observe.wandb_project if observe.wandb else None,
        config=cfg.to_dict(),
        histograms_every=observe.histograms_every,
    )
