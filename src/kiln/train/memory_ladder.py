"""The out-of-memory ladder: what a run changes, in order, when the device runs out of memory.

Each rung keeps the global batch, and so the mathematics of training, unchanged:

1. halve the micro-batch (accumulation doubles), down to one sequence;
2. recompute activations in the backward pass (activation checkpointing);
3. with FSDP on a GPU, keep parameters, gradients and optimizer state in CPU memory.

The rung reached is part of the run's state: it is saved in checkpoints and in
``RUN_DIR/memory.json`` (written at once, before any restart), and a resumed run starts there.
``starting_rung`` decides where a run starts before anything is built (the rung's CPU offload
decides how the model is sharded); ``MemoryLadder``, made around the run's ``TrainStep``, is the
loop's component for the rest: the micro-batch in use, the probe for ``train.micro_batch_size =
"auto"``, and the retry one rung down.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kiln.checkpoint import CheckpointError, capture_rng, restore_rng
from kiln.config import Config, ConfigError
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.loader import StepBatches, dataset_len
from kiln.distributed.world import World
from kiln.io import write_atomic
from kiln.train.step import TrainStep

RUNG_FILE = "memory.json"


@dataclass(frozen=True)
class Rung:
    micro_batch_size: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False

    def describe(self) -> str:
        extras = [
            name
            for name, on in (
                ("activation checkpointing", self.activation_checkpointing),
                ("CPU offload", self.cpu_offload),
            )
            if on
        ]
        return f"micro-batch {self.micro_batch_size}" + "".join(f" + {e}" for e in extras)

    def merge(self, other: Rung | None) -> Rung:
        """The more frugal of two rungs, field by field."""
        if other is None:
            return self
        return Rung(
            min(self.micro_batch_size, other.micro_batch_size),
            self.activation_checkpointing or other.activation_checkpointing,
            self.cpu_offload or other.cpu_offload,
        )

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict | None) -> Rung | None:
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
        raise CheckpointError(
            f"{path}: not a kiln memory rung file ({e}); delete it to start from the config's settings"
        ) from None


def write_rung_file(run_dir: Path, rung: Rung) -> None:
    # Any rank may write it (the one that ran out of memory).
    write_atomic(run_dir / RUNG_FILE, json.dumps(rung.state_dict(), indent=2))


class OutOfMemoryExhausted(RuntimeError):  # noqa: N818
    """Every rung was tried; the message is the report of what was tried."""


class RestartForRung(RuntimeError):  # noqa: N818
    """The next rung cannot be reached inside this process (other ranks wait in collectives, or
    the model must be sharded anew for CPU offload): it is saved, and a restart starts there."""


# Share of device memory the micro-batch probe leaves free, for what a probe does not show
# (allocator fragmentation, evaluation, a longer document mix).
PROBE_MARGIN = 0.10


def micro_batch_choices(schedule: BatchSchedule, world: World) -> list[int]:
    """Micro-batch sizes that split each data-parallel rank's share of every global batch of
    ``schedule``, largest first (ConfigError where a batch does not split over the ranks)."""
    dp = world.data_ranks
    uneven = [b for b in schedule.sizes() if b % dp]
    if uneven:
        key = "train.global_batch_size" if uneven[0] == schedule.final else "train.batch_ramp_start/increment"
        raise ConfigError(
            [f"{key}: global batch {uneven[0]} is not a multiple of the {dp} data-parallel ranks (over cp)"]
        )
    return micro_batch_options([b // dp for b in schedule.sizes()])


class Start(NamedTuple):
    """Where a run's ladder starts: its rung, and whether the micro-batch is still to be probed."""

    rung: Rung
    probe: bool


def starting_rung(
    cfg: Config, world: World, schedule: BatchSchedule, run_dir: Path, say: Callable[[str], None]
) -> Start:
    """Where the run starts, decided before anything is built: the config's settings, made more
    frugal by a rung the run already reached (memory.json, said with ``say``); and whether the
    micro-batch is still to be probed (``train.micro_batch_size = "auto"``)."""
    t, options = cfg.train, micro_batch_choices(schedule, world)
    micro = t.micro_batch_size
    if micro != "auto" and micro not in options:
        dp = world.data_ranks
        shares = ", ".join(f"{b} / {dp} = {b // dp}" for b in schedule.sizes())
        raise ConfigError(
            [
                f"train.micro_batch_size: {micro} does not divide each data-parallel rank's share of "
                f"train.global_batch_size ({shares}); accumulation steps must be a whole number"
            ]
        )
    if micro == "auto" and world.distributed and (cfg.parallel.strategy != "ddp" or world.tp > 1):
        # Probing is safe only without collectives in forward/backward: one rank running
        # out of memory inside an FSDP all-gather would leave the others waiting there.
        raise ConfigError(
            [
                "train.micro_batch_size: auto works with one process or DDP; with FSDP or tensor "
                "parallelism set a number (kiln plan estimates what fits)"
            ]
        )
    rung = Rung(options[0] if micro == "auto" else micro, bool(t.activation_checkpointing), cfg.parallel.cpu_offload)
    saved = None if cfg.checkpoint.resume == "never" else read_rung_file(run_dir)
    if saved is not None:
        if saved.micro_batch_size not in options:
            saved = replace(saved, micro_batch_size=max(m for m in options if m <= saved.micro_batch_size))
        rung = rung.merge(saved)
        say(
            f"kiln: continuing with {rung.describe()}, where this run's out-of-memory ladder got to "
            f"({run_dir / RUNG_FILE}; delete it to start from the config's settings)"
        )
    return Start(rung, micro == "auto" and saved is None)


class Attempt:
    """One try at a step's forward and backward: its with block catches an out-of-memory error,
    kept as ``error`` (its first line) for the ladder, and lets every other exception through."""

    error: str | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> bool:
        if kind is None or not issubclass(kind, torch.OutOfMemoryError):
            return False
        self.error = str(error).splitlines()[0]
        return True


class MemoryLadder:
    """The micro-batch a run computes with, and the ladder it steps down when memory runs out,
    from ``start`` (``starting_rung``) on ``step``, the run's TrainStep: ``attempts`` retries a
    step's forward and backward on the same batch one rung down each time the device runs out of
    memory."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        schedule: BatchSchedule,
        run_dir: Path,
        step: TrainStep,
        start: Start,
    ):
        self.cfg, self.world, self.schedule, self.run_dir, self.train_step = cfg, world, schedule, run_dir, step
        self.options = micro_batch_choices(schedule, world)
        self._fitted = schedule.final  # the global batch the options split
        self.rung, self.probe_needed = start
        self.history: list[tuple[Rung, str]] = []
        self._apply(self.rung)

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch of the current rung. Where the time plan has chosen the global batch
        since (``global_batch_size = "auto"`` resizes the run's BatchSchedule), micro-batches that
        split each rank's share of the new batch first, none larger than that share."""
        if self._fitted != self.schedule.final:
            self._fitted, self.options = self.schedule.final, micro_batch_choices(self.schedule, self.world)
            micro = self.rung.micro_batch_size
            if micro not in self.options:
                self._apply(replace(self.rung, micro_batch_size=max(m for m in self.options if m <= micro)))
        return self.rung.micro_batch_size

    def state_dict(self) -> dict:
        return self.rung.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        saved = Rung.from_state(state)
        if saved is not None:
            # Offload is decided when the model is sharded, from memory.json; the rest applies now.
            self._apply(self.rung.merge(replace(saved, cpu_offload=self.rung.cpu_offload)))
            self.probe_needed = False

    def attempts(self, step: int, logger: Any, save: Callable[[], Path]) -> Iterator[Attempt]:
        """Tries at (1-based) ``step``'s forward and backward, one rung down after each that runs
        out of memory, always on the same sequences::

            for attempt in ladder.attempts(step, logger, save):
                with attempt:
                    loss = train_step.forward_backward(split_batch(batch, ladder.micro_batch_size), step)

        ``save()`` writes a checkpoint of the last completed step (before a restart, or the end)."""
        while True:
            attempt = Attempt()
            yield attempt
            if attempt.error is None:
                return
            # Here, after the with block: the failed try's frames, and the activations they
            # reference, are gone before the retry allocates anew.
            self._step_down(attempt.error, step, logger, save)

    def _apply(self, rung: Rung) -> None:
        if rung.activation_checkpointing:
            self.train_step.recompute_activations()
        self.rung = rung

    # -- out of memory ----------------------------------------------------------------------------

    def _step_down(self, error: str, step: int, logger: Any, save: Callable[[], Path]) -> None:
        """After an out-of-memory error in forward/backward: free, move one rung down, go on."""
        self.train_step.discard_gradients()
        self.history.append((self.rung, error))
        where = f"out of memory at step {step} with {self.rung.describe()}"
        can_offload = self.cfg.parallel.strategy != "ddp" and self.world.device.type == "cuda"
        rung = next_rung(self.rung, self.options, can_offload=can_offload)
        if rung is None:
            # The other ranks of a group wait in a collective: only a single process saves.
            saved = None if self.world.distributed else save()
            raise OutOfMemoryExhausted(self._report(where, step - 1, saved))
        if self.world.distributed or rung.cpu_offload:
            # Other ranks are inside collectives of this step (or the model must be sharded anew):
            # the rung is saved and the run restarts from its last checkpoint.
            write_rung_file(self.run_dir, rung)
            if not self.world.distributed:
                save()
            raise RestartForRung(
                f"{where} ({error}); it will continue from its last checkpoint with "
                f"{rung.describe()}, saved in {self.run_dir / RUNG_FILE}: run the same command "
                "again (kiln launch --max-restarts N restarts by itself)"
            )
        self._apply(rung)
        if self.world.is_main:
            write_rung_file(self.run_dir, rung)
        accum = self.schedule.batch_size(step - 1) // self.world.data_ranks // rung.micro_batch_size
        logger.event(
            step,
            "out_of_memory",
            f"{where}: retrying the step with {rung.describe()} (accumulation {accum}; the global batch is unchanged)",
            error=error,
            **rung.state_dict(),
        )

    def _report(self, where: str, done: int, saved: Path | None) -> str:
        tried = "\n".join(f"  - {rung.describe()}: {error}" for rung, error in self.history)
        kept = f"\nThe state after step {done} is saved in {saved.parent}." if saved is not None else ""
        return (
            f"{where}, the last rung of the out-of-memory ladder.\nTried:\n{tried}{kept}\n"
            "To fit: a shorter data.seq_len, a smaller model, parallel.strategy=fsdp over more GPUs (with "
            "parallel.cpu_offload=true), or a GPU with more memory; `kiln plan` estimates each."
        )

    # -- train.micro_batch_size = "auto" ------------------------------------------------------------

    def find_micro_batch(self, batches: StepBatches, done: int, logger: Any) -> None:
        """The largest micro-batch whose forward and backward fit (with a margin on GPU), found by
        bisection over real passes on training data; ``done`` steps are already trained."""
        device = self.world.device
        rng = capture_rng()  # probing must not change what the run draws afterwards
        items = dataset_len(batches.dataset)

        def fits(m: int) -> bool:
            batch = batches.collate([i % items for i in range(m)], device)
            failed = False
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                self.train_step.forward_backward([batch], done + 1, sync=False)
                failed = not self._leaves_headroom()
            except torch.OutOfMemoryError as e:
                self.history.append((replace(self.rung, micro_batch_size=m), str(e).splitlines()[0]))
                failed = True
            self.train_step.discard_gradients()
            (failed,) = self.world.agree(failed)  # every rank takes the same size
            return not failed

        best = largest_fitting(self.options, fits)
        if best is None:
            self._apply(replace(self.rung, activation_checkpointing=True))
            best = largest_fitting(self.options, fits)
        restore_rng(rng)
        if best is None:
            raise OutOfMemoryExhausted(
                self._report(
                    "train.micro_batch_size=auto: out of memory at micro-batch 1 with activation checkpointing",
                    done,
                    None,
                )
            )
        self.rung = replace(self.rung, micro_batch_size=best)
        if self.world.is_main:
            write_rung_file(self.run_dir, self.rung)
        accum = self.schedule.final // self.world.data_ranks // best
        logger.event(
            done,
            "micro_batch_size",
            f"train.micro_batch_size=auto: {self.rung.describe()} fits, accumulation {accum}",
            **self.rung.state_dict(),
        )

    def _leaves_headroom(self) -> bool:
        """On a GPU, would the probed pass leave the margin free once AdamW has its state too?"""
        device = self.world.device
        if device.type != "cuda":
            return True
        total = torch.cuda.get_device_properties(device).total_memory
        states = 0 if self.train_step.optimizer.state else 2 * sum(p.numel() * 4 for p in self.train_step.params)
        return torch.cuda.max_memory_reserved(device) + states <= (1 - PROBE_MARGIN) * total
