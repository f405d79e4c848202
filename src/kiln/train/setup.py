"""The start of a run, before its first step: the run directory claimed, the model this rank
trains, made and laid out, the batches it reads, and how long each part took, said in one line
once the first step is done (where a large model's minutes before training go)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch

from kiln.config import ConfigError, ParallelConfig
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.loader import StepBatches
from kiln.device import return_freed_host_memory
from kiln.distributed.parallel import ParallelModel
from kiln.distributed.parallelize import parallelize
from kiln.distributed.world import World
from kiln.observe.progress import counted
from kiln.train.apply import check_quantized_shards
from kiln.train.faults import NoFaults
from kiln.train.jobs import Job
from kiln.train.precision import Precision


class SetupTimes:
    """Seconds spent on each part of the start (building the model, laying it out and
    initialising or loading it, loading a checkpoint, the first step with its compilation)."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.parts: dict[str, float] = {}
        self._loop: float | None = None

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.parts[part] = time.perf_counter() - start

    def loop_starts(self) -> None:
        self._loop = time.perf_counter()

    def step_done(self) -> None:
        """After each step; after the run's first, say the setup line (parts that took no
        measurable time left out)."""
        if self._loop is None:
            return
        self.parts["first step"], self._loop = time.perf_counter() - self._loop, None
        said = ", ".join(f"{part} {seconds:.1f}s" for part, seconds in self.parts.items() if seconds >= 0.05)
        self.say(f"kiln: setup: {said}")


def start_model(
    job: Job,
    world: World,
    pcfg: ParallelConfig,
    precision: Precision,
    faults: NoFaults,
    times: SetupTimes,
) -> ParallelModel:
    """This rank's share of the job's model: built (on ``meta`` where the job can say each
    tensor's starting value by name, so that each rank writes only its own shards), made its
    precision's (frozen weights in the compute dtype, fp8's layers), given the test faults, and
    laid out over ``world`` as ``pcfg`` says.

    A rank that gathers sharded layers on the host (FSDP on the CPU, or offloaded), and any rank
    of a GPU, whose loop allocates little on the host, has the host allocator return large freed
    blocks at once, so that its resident memory is its live tensors. Not a plain CPU run: there
    it would turn every large activation into fresh pages (about half the speed, measured)."""
    sharded = pcfg.strategy != "ddp" and (world.dp > 1 or pcfg.cpu_offload)
    if world.device.type == "cuda" or sharded:
        return_freed_host_memory()
    with times.timed("build"):
        model = job.model()
        precision.convert(model)
    if sharded:
        check_quantized_shards(model, world.dp_shard * world.cp)  # HSDP's replicas hold whole shards
    for line in job.describe(model) + (job.initial.describe() if job.initial else []) + precision.describe():
        times.say(f"kiln: {line}")
    faults.attach(model)
    if job.initial is not None and world.is_main:
        job.initial.progress = counted
    with times.timed(f"shard + {job.initial.part}" if job.initial else "shard"):
        model = model if job.initial else model.to(world.device)
        bf16 = precision.dtype == torch.bfloat16
        return parallelize(model, job.plan, world, pcfg, bf16=bf16, initial=job.initial, seq_len=job.cfg.data.seq_len)


def step_batches(job: Job, schedule: BatchSchedule, world: World) -> StepBatches:
    """The batches of each step as this rank reads them (ranks of one tensor- or context-parallel
    group read the same ones), each for as many steps as the job asks."""
    return StepBatches(
        job.train_data,
        schedule,
        job.cfg.train.seed,
        num_workers=job.cfg.data.num_workers,
        pin_memory=world.device.type == "cuda",
        rank=world.data_rank,
        world_size=world.data_ranks,
        collate_fn=job.collate_fn,
        repeat=job.repeat,
    )


CLAIM_FILE = ".kiln-run"
# What only a kiln run directory holds (config.toml alone is not one: a user's config may sit there).
RUN_MARKERS = (CLAIM_FILE, "env.json", "metrics.jsonl", "model.json", "memory.json", "checkpoints")


class RunClaim:
    """The run directory, claimed by the process that trains into it (its main rank), from the
    start of ``fit`` to its end: a second ``kiln train`` on it stops at once, naming this one,
    instead of both writing it. A directory that holds files but no kiln run is refused when the
    claim is made, before anything is prepared or written. The claim is an advisory lock on
    ``RUN_DIR/.kiln-run``, which the OS drops when the process ends, however it ends."""

    def __init__(self, run_dir: Path, main: bool):
        self.run_dir, self.main = run_dir, main
        self.file: IO[str] | None = None
        found = sorted(p.name for p in run_dir.iterdir()) if main and run_dir.is_dir() else []
        if found and not any((run_dir / marker).exists() for marker in RUN_MARKERS):
            shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise ConfigError([f"run.dir: {run_dir} holds files but no kiln run ({shown}); choose a new or empty one"])

    def __enter__(self) -> RunClaim:
        if not self.main:
            return self
        me = f"kiln train (pid {os.getpid()} on {socket.gethostname()})"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.run_dir / CLAIM_FILE, "a+")  # noqa: SIM115 - held until __exit__
        try:
            # A POSIX record lock, not flock: it belongs to this process alone, so a data loader's
            # workers forked from it do not keep holding it after it is killed.
            fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise ConfigError(
                [f"run.dir: {self.run_dir} is being trained by {holder}; wait for it to end or choose another run.dir"]
            ) from None
        file.seek(0)
        file.truncate()
        file.write(me + "\n")
        file.flush()
        self.file = file
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()  # and with it the lock
            self.file = None
