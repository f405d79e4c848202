"""Test-only fault injection, all in one place: the device "running out of memory" above a
micro-batch size, one module's output going NaN at chosen steps, a slow disk under the
checkpoint writer, and a rank that hangs or is slow.

Faults come from the run's ``[debug]`` section (``--set debug.oom_above=4``, or a ``Config``
built in Python), which is validated like every other; a run without any gets ``NO_FAULTS``,
whose hooks do nothing. The training step tells the faults, at one place, which step and
micro-batch is about to run forward; the NaN acts through a forward hook on the named module;
the checkpoint writer calls ``writing_checkpoint`` before it writes a checkpoint's files.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any

import torch
from torch import nn

from kiln.config import DebugConfig


class NoFaults:
    """The faults of a run that asks for none: every hook does nothing."""

    def attach(self, model: nn.Module) -> None:
        """Install what acts through the model (the NaN)."""

    def before_forward(self, step: int, rows: int, checkpointing: bool) -> None:
        """Step ``step`` (1-based) is about to run a forward pass over ``rows`` sequences."""

    def writing_checkpoint(self) -> None:
        """The main rank is about to write a checkpoint's files (from a copy, when in the background)."""

    def rolled_back(self, reached: int) -> None:
        """A rollback from step ``reached``."""


NO_FAULTS = NoFaults()


class Faults(NoFaults):
    """The faults ``debug`` asks for, on rank ``rank``."""

    def __init__(self, debug: DebugConfig, rank: int = 0):
        self.debug, self.rank = debug, rank
        self.nan_steps = debug.nan_step_set
        # A hang happens in the first attempt only: once ``kiln launch --max-restarts`` has
        # restarted the workers (torchrun counts the restarts), the group runs on.
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.hang_step = debug.hang_step if first_attempt else 0
        self.step = 0  # the step whose forward runs now (1-based)
        self._cured: set[int] = set()
        self._saves = 0  # checkpoint writes so far (debug.disk_full_save)

    def attach(self, model: nn.Module) -> None:
        if not self.nan_steps:
            return
        modules = dict(model.named_modules())
        name = self.debug.nan_module or ("blocks.1.mlp" if "blocks.1.mlp" in modules else "")
        if name not in modules:
            raise ValueError(f"debug.nan_module: the model has no module named {name!r}")
        modules[name].register_forward_hook(self._poison)

    def before_forward(self, step: int, rows: int, checkpointing: bool) -> None:
        d = self.debug
        self.step = step
        if self.rank == d.hang_rank and step == self.hang_step:
            while True:  # until the hang watchdog (or the agent) ends the process
                time.sleep(60)
        if d.slow_seconds and self.rank == d.slow_rank:
            time.sleep(d.slow_seconds)
        if d.oom_above < 0 or step - 1 < d.oom_from_step or rows <= d.oom_above:
            return
        if checkpointing and d.oom_unless_checkpointing:
            return
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by debug.oom_above={d.oom_above}: micro-batch of {rows} at step {step})"
        )

    def writing_checkpoint(self) -> None:
        time.sleep(self.debug.slow_save_seconds)
        self._saves += 1
        if self._saves == self.debug.disk_full_save:
            raise OSError(errno.ENOSPC, "No space left on device (injected by debug.disk_full_save)")

    def rolled_back(self, reached: int) -> None:
        """The poisoned steps up to ``reached`` are cured (unless the NaN persists)."""
        if not self.debug.nan_persist:
            self._cured |= {s for s in self.nan_steps if s <= reached}

    def _poison(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        if self.step in self.nan_steps and (self.debug.nan_persist or self.step not in self._cured):
            return output * float("nan")
        return output


def faults_for(debug: DebugConfig, rank: int) -> NoFaults:
    """The faults a run's ``[debug]`` section asks for (``NO_FAULTS`` when it asks for none)."""
    return NO_FAULTS if debug == DebugConfig() else Faults(debug, rank)
