"""The live progress bar of a run on a terminal (rich): the step of the total, the last logged
loss and tokens/s, elapsed time and ETA. Whatever the run prints meanwhile (log lines, events,
samples) scrolls above it; off a terminal there is no bar, only those lines."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


class ProgressBar:
    def __init__(self, total: int, start: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self._task = self._progress.add_task("train", total=total or None, completed=start, status="")
        self._progress.start()

    def set_total(self, total: int) -> None:
        self._progress.update(self._task, total=total)

    def advance(self, step: int) -> None:
        self._progress.update(self._task, completed=step)

    def show(self, values: dict[str, Any]) -> None:
        """The latest training record's loss and throughput beside the bar."""
        parts = []
        if "loss" in values:
            parts.append(f"loss {values['loss']:.4g}")
        if "tokens_per_s" in values:
            parts.append(f"{values['tokens_per_s']:,.0f} tok/s")
        if parts:
            self._progress.update(self._task, status=" | ".join(parts))

    def close(self) -> None:
        self._progress.stop()


@contextlib.contextmanager
def counted(what: str, total: int) -> Iterator[Callable[[], None]]:
    """A bar of ``total`` items (``what``: "loading weights") while the block runs, on a terminal
    and for more than a few items; yields the function that counts one done."""
    if total < 16 or not sys.stdout.isatty():
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(what), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
