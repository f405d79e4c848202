"""One logger, three sinks: console line, ``metrics.jsonl`` and TensorBoard event files.

The training loop hands over plain floats at log intervals only; turning device tensors into
floats (a host sync) is the loop's business and happens once per interval.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
# Logged to the files, left off the console line to keep it short.
CONSOLE_HIDDEN = {"memory/peak_reserved_gib", "global_batch", "micro_batch_size", "tokens"}


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


class MetricsLogger:
    """Writes each logged step to every sink. ``start_step`` > 0 means a resumed run: records
    of later steps (written before the interruption, and about to be redone) are dropped so
    the history stays one line per step."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, start_step: int = 0,
                 console: bool = True, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.console = console
        self.path = self.run_dir / METRICS_FILE
        self._truncate_after(start_step)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step or None)
        self._start_step = start_step
        self._t0 = time.perf_counter()

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if self.console:
            print(self._console_line(step, values), flush=True)

    def _console_line(self, step: int, values: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        parts += [_fmt(k, v) for k, v in values.items()
                  if k not in CONSOLE_HIDDEN and (k != "skipped_steps" or v)]
        done = step - self._start_step
        if 0 < done and step < self.total_steps and "val_loss" not in values:
            elapsed = time.perf_counter() - self._t0
            parts.append(f"ETA {format_duration(elapsed / done * (self.total_steps - step))}")
        return " | ".join(parts)

    def event(self, step: int, kind: str, message: str, **details: Any) -> None:
        """Something the run did by itself (e.g. a smaller micro-batch after running out of
        memory): a line in metrics.jsonl with an "event" key, TensorBoard text, the console."""
        self._file.write(json.dumps({"step": step, "event": kind, "message": message, **details}) + "\n")
        if self._tb is not None:
            self._tb.add_text(f"events/{kind}", message, step)
        if self.console:
            print(f"kiln: {message}", flush=True)

    def text(self, step: int, tag: str, text: str) -> None:
        """A text record (e.g. a generated sample): console, TensorBoard, and ``samples.txt``."""
        with open(self.run_dir / "samples.txt", "a") as f:
            f.write(f"--- step {step} ({tag}) ---\n{text}\n")
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self.console:
            print(f"--- {tag} at step {step} ---\n{text}\n---", flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullLogger:
    """The logger of ranks other than 0: takes every record and writes nothing."""

    def log(self, step: int, values: dict[str, Any]) -> None:
        pass

    def text(self, step: int, tag: str, text: str) -> None:
        pass

    def event(self, step: int, kind: str, message: str, **details: Any) -> None:
        pass

    def __enter__(self) -> "NullLogger":
        return self

    def __exit__(self, *exc) -> None:
        pass
