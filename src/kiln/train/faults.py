"""Test-only fault injection, all in one place: the device "running out of memory" above a
micro-batch size, one module's output going NaN at chosen steps, a slow disk under the
checkpoint writer, and a rank that hangs or is slow.

A ``Faults`` object is given to the Trainer (or made from the environment, so that ``kiln
train`` run as a subprocess can be given faults too: ``from_env`` is the only place kiln reads
these variables). The loop's step tells it, at one place (``TrainStep.loss``), which step and
micro-batch is about to run forward; the NaN acts through a forward hook on the named module;
the checkpoint writer calls ``writing_checkpoint`` before it writes a checkpoint's files.

Environment variables:

``KILN_TEST_OOM_ABOVE=N``: any micro-batch of more than N sequences fails (0: every one), with
the exception type the CUDA allocator raises;
``KILN_TEST_OOM_FROM_STEP=S``: only once S optimizer steps are done (default 0);
``KILN_TEST_OOM_UNLESS_CHECKPOINTING=1``: activation checkpointing makes any micro-batch fit;
``KILN_TEST_NAN_STEPS=7,8,9``: the steps (1-based, as logged) whose forward pass goes NaN, until
a rollback passes over them (as if the lower learning rate "fixed" it), or always with
``KILN_TEST_NAN_PERSIST=1``;
``KILN_TEST_NAN_MODULE=blocks.1.mlp``: the module whose output is poisoned (default: the second
block's MLP, or the model itself if it has no such module);
``KILN_TEST_SLOW_SAVE_SECONDS=S``: every checkpoint write pauses S seconds before the main rank
writes its files (in the background with checkpoint.async_save, while training goes on);
``KILN_TEST_HANG_RANK=R`` with ``KILN_TEST_HANG_STEP=S``: rank R (default 0) stops for good before
step S's forward pass, as a rank stuck outside a collective would, in the first attempt only (once
``kiln launch --max-restarts`` has restarted the workers, TORCHELASTIC_RESTART_COUNT > 0, it runs);
``KILN_TEST_SLOW_RANK=R`` with ``KILN_TEST_SLOW_SECONDS=S``: each forward pass of rank R takes S
seconds longer (a straggler).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Faults:
    oom_above: int | None = None
    oom_from_step: int = 0
    oom_unless_checkpointing: bool = False
    nan_steps: frozenset[int] = frozenset()
    nan_persist: bool = False
    nan_module: str = ""
    slow_save_s: float = 0.0
    rank: int = 0  # this process's (RANK under torchrun): the faults below hit one rank
    hang_rank: int = 0
    hang_step: int | None = None
    slow_rank: int = 0
    slow_s: float = 0.0
    step: int = field(default=0, init=False)  # the step whose forward runs now (1-based)
    _cured: set[int] = field(default_factory=set, init=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Faults:
        above = env.get("KILN_TEST_OOM_ABOVE")
        hang = env.get("KILN_TEST_HANG_STEP")
        first_attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        return cls(
            oom_above=int(above) if above else None,
            oom_from_step=int(env.get("KILN_TEST_OOM_FROM_STEP", "0")),
            oom_unless_checkpointing=env.get("KILN_TEST_OOM_UNLESS_CHECKPOINTING") == "1",
            nan_steps=frozenset(int(s) for s in env.get("KILN_TEST_NAN_STEPS", "").split(",") if s.strip()),
            nan_persist=env.get("KILN_TEST_NAN_PERSIST") == "1",
            nan_module=env.get("KILN_TEST_NAN_MODULE", ""),
            slow_save_s=float(env.get("KILN_TEST_SLOW_SAVE_SECONDS", "0")),
            rank=int(env.get("RANK", "0")),
            hang_rank=int(env.get("KILN_TEST_HANG_RANK", "0")),
            hang_step=int(hang) if hang and first_attempt else None,
            slow_rank=int(env.get("KILN_TEST_SLOW_RANK", "0")),
            slow_s=float(env.get("KILN_TEST_SLOW_SECONDS", "0")),
        )

    def attach(self, model: nn.Module) -> None:
        """Install the NaN, if any is asked for, on the model (a no-op otherwise)."""
        if not self.nan_steps:
            return
        modules = dict(model.named_modules())
        name = self.nan_module or ("blocks.1.mlp" if "blocks.1.mlp" in modules else "")
        if name not in modules:
            raise ValueError(f"KILN_TEST_NAN_MODULE: the model has no module named {name!r}")
        modules[name].register_forward_hook(self._poison)

    def before_forward(self, step: int, rows: int, checkpointing: bool) -> None:
        """Step ``step`` (1-based) is about to run a forward pass over ``rows`` sequences."""
        self.step = step
        if self.rank == self.hang_rank and step == self.hang_step:
            while True:  # until the hang watchdog (or the agent) ends the process
                time.sleep(60)
        if self.slow_s and self.rank == self.slow_rank:
            time.sleep(self.slow_s)
        if self.oom_above is None or step - 1 < self.oom_from_step or rows <= self.oom_above:
            return
        if checkpointing and self.oom_unless_checkpointing:
            return
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by KILN_TEST_OOM_ABOVE={self.oom_above}: micro-batch of {rows} "
            f"at step {step})"
        )

    def writing_checkpoint(self) -> None:
        """The main rank is about to write a checkpoint's files (from a copy, when in the background)."""
        time.sleep(self.slow_save_s)

    def rolled_back(self, reached: int) -> None:
        """A rollback from step ``reached``: the poisoned steps up to there are cured."""
        if not self.nan_persist:
            self._cured |= {s for s in self.nan_steps if s <= reached}

    def _poison(self, module, inputs, output):
        if self.step in self.nan_steps and (self.nan_persist or self.step not in self._cured):
            return output * float("nan")
        return output
