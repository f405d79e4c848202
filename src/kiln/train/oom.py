"""The out-of-memory ladder: what a run changes, in order, when the device runs out of memory.

Each rung keeps the global batch, and so the mathematics of training, unchanged:

1. halve the micro-batch (accumulation doubles), down to one sequence;
2. recompute activations in the backward pass (activation checkpointing);
3. with FSDP on a GPU, keep parameters, gradients and optimizer state in CPU memory.

The rung reached is part of the run's state: it is saved in checkpoints and in
``RUN_DIR/memory.json`` (written at once, before any restart), and a resumed run starts there.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint import CheckpointError, write_atomic

RUNG_FILE = "memory.json"


@dataclass(frozen=True)
class Rung:
    micro_batch_size: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False

    def describe(self) -> str:
        extras = [name for name, on in (("activation checkpointing", self.activation_checkpointing),
                                        ("CPU offload", self.cpu_offload)) if on]
        return f"micro-batch {self.micro_batch_size}" + "".join(f" + {e}" for e in extras)

    def merge(self, other: "Rung | None") -> "Rung":
        """The more frugal of two rungs, field by field."""
        if other is None:
            return self
        return Rung(min(self.micro_batch_size, other.micro_batch_size),
                    self.activation_checkpointing or other.activation_checkpointing,
                    self.cpu_offload or other.cpu_offload)

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict | None) -> "Rung | None":
        return cls(**state) if state else None


def micro_batch_options(per_rank_batches: list[int]) -> list[int]:
    """Micro-batch sizes that split every step's per-rank batch evenly, largest first."""
    whole = math.gcd(*per_rank_batches)
    return [m for m in range(whole, 0, -1) if whole % m == 0]


def next_rung(rung: Rung, options: list[int], *, can_offload: bool) -> Rung | None:
    """The next rung down, or None when the ladder is exhausted."""
    smaller = [m for m in options if m <= rung.micro_batch_size // 2]
    if smaller:
        return replace(rung, micro_batch_size=smaller[0])
    if not rung.activation_checkpointing:
        return replace(rung, activation_checkpointing=True)
    if can_offload and not rung.cpu_offload:
        return replace(rung, cpu_offload=True)
    return None


def largest_fitting(options: list[int], fits: Callable[[int], bool]) -> int | None:
    """Binary search over ``options`` (largest first) for the largest size that fits, assuming
    that what fits at size m fits at every smaller size."""
    lo, hi, best = 0, len(options) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(options[mid]):
            best, hi = options[mid], mid - 1
        else:
            lo = mid + 1
    return best


def read_rung_file(run_dir: Path) -> Rung | None:
    path = run_dir / RUNG_FILE
    try:
        return Rung.from_state(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: not a kiln memory rung file ({e}); delete it to start from the config's "
                              "settings") from None


def write_rung_file(run_dir: Path, rung: Rung) -> None:
    # Any rank may write it (the one that ran out of memory).
    write_atomic(run_dir / RUNG_FILE, json.dumps(rung.state_dict(), indent=2))


class OutOfMemoryExhausted(RuntimeError):
    """Every rung was tried; the message is the report of what was tried."""


class RestartForRung(RuntimeError):
    """The next rung cannot be reached inside this process (other ranks wait in collectives, or
    the model must be sharded anew for CPU offload): it is saved, and a restart starts there."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError)


class InjectedOOM:
    """A test hook that makes the device "run out of memory" above a micro-batch size, raising
    the exception type the CUDA allocator raises. Set by environment, so it works for
    ``kiln train`` as well as for the Python API:

    ``KILN_TEST_OOM_ABOVE=N``: any micro-batch of more than N sequences fails (0: every one);
    ``KILN_TEST_OOM_FROM_STEP=S``: only from optimizer step S on (default 0);
    ``KILN_TEST_OOM_UNLESS_CHECKPOINTING=1``: activation checkpointing makes any micro-batch fit.
    """

    def __init__(self) -> None:
        above = os.environ.get("KILN_TEST_OOM_ABOVE")
        self.above = int(above) if above else None
        self.from_step = int(os.environ.get("KILN_TEST_OOM_FROM_STEP", "0"))
        self.checkpointing_fits = os.environ.get("KILN_TEST_OOM_UNLESS_CHECKPOINTING") == "1"

    def check(self, micro_batch_size: int, step: int, rung: Rung) -> None:
        if self.above is None or step < self.from_step or micro_batch_size <= self.above:
            return
        if rung.activation_checkpointing and self.checkpointing_fits:
            return
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by KILN_TEST_OOM_ABOVE={self.above}: micro-batch of {micro_batch_size} "
            f"at step {step})"
        )
