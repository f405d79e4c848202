"""What a checkpoint of a run holds, when the loop saves one, and how a run resumes from it.

A checkpoint is the model and optimizer (keyed by parameter name, so any strategy or world size
can load it; each rank's shards when sharded) and one dict of the loop's stateful parts, each
saved with its ``state_dict`` and restored with its ``load_state_dict``: precision (fp16's loss
scale), the memory ladder's rung, the guard. Beside them: the step, the RNG state, the data
position (a pure function of seed and step), the config and the parallel layout.

With ``checkpoint.async_save`` the training thread only copies that state to host memory and a
background thread writes it; at most one write is in flight, and anything that reads or writes
checkpoints (the next save, a rollback, a resume, the end of the loop) first waits for it.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kiln.checkpoint import (
    CheckpointError,
    Stateful,
    capture_rng,
    host_stager,
    latest_checkpoint,
    list_checkpoints,
    load_sharded,
    open_checkpoint,
    restore_rng,
    save_checkpoint,
    save_checkpoint_async,
    set_aside_after,
    write_failed,
)
from kiln.config import Config
from kiln.data.loader import StepBatches
from kiln.distributed.parallel import ParallelModel, local_part
from kiln.distributed.world import World
from kiln.train.faults import NO_FAULTS, NoFaults

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from kiln.train.run import Progress


class Checkpointer:
    def __init__(
        self,
        cfg: Config,
        world: World,
        model: ParallelModel,
        optimizer: torch.optim.Optimizer,
        parts: Mapping[str, Stateful],
        batches: StepBatches,
        say: Callable[[str], None],
        faults: NoFaults = NO_FAULTS,
    ):
        self.cfg, self.world, self.optimizer = cfg, world, optimizer
        self.model: nn.Module = model.module
        self.load_whole = model.load_whole
        self.parts, self.batches, self._say = parts, batches, say
        self.faults = faults
        self.dir = Path(cfg.run.dir) / "checkpoints"
        # Sharded (every rank writes its own part with DCP) where ranks hold different parts.
        self.sharded = model.sharded
        self._writing: tuple[Path, Future[None]] | None = None  # the checkpoint written in the background
        self._holding = False  # between hold and put_back: checkpoints saved then are not the run's
        self._stager = None  # the host copy of the state it is written from, reused by the next
        # DCP's collectives in the background (planning the write, gathering its results) get a
        # gloo group of their own; every rank makes it here, together.
        self._write_group = None
        if cfg.checkpoint.async_save and self.sharded:
            import torch.distributed as dist

            self._write_group = dist.new_group(backend="gloo")

    phase = "save"

    def after_step(self, run: Progress) -> None:
        """Save at the checkpoint interval, at the run's end and where it stops."""
        if self.due(run.step, run.final or run.stop.requested):
            self.save(run.step)

    def due(self, step: int, now: bool = False) -> bool:
        """Is ``step`` (just done) a checkpoint? ``now``: the run ends or stops here."""
        every = self.cfg.checkpoint.every
        return now or bool(every and step % every == 0)

    def latest(self) -> Path | None:
        self.wait()
        return latest_checkpoint(self.dir)

    def save(self, step: int) -> Path:
        """Checkpoint ``step``; with ``checkpoint.async_save`` it is complete only after ``wait``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        # Model and optimizer state keyed by parameter name (no "module." of DDP), each rank's
        # shards when sharded: so any strategy or world size can load it back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=_options(self.sharded))
        train_state: dict[str, Any] = {
            "step": step,
            **{name: part.state_dict() for name, part in self.parts.items()},
            "rng": capture_rng(),
            # The data order is a pure function of (seed, step): this is the whole position.
            "data": self.batches.position(step),
            "config": self.cfg.to_dict(),
            "world": {
                "size": self.world.size,
                "pp": self.world.pp,
                "tp": self.world.tp,
                "strategy": self.cfg.parallel.strategy,
            },
        }
        weights: dict[str, torch.Tensor] | None
        sharded: dict[str, Any] | None
        if self.sharded:
            weights, sharded = None, {"model": model_state, "optimizer": optim_state}
        else:
            # Unsharded: the model's state is plain tensors.
            weights, sharded = cast("dict[str, torch.Tensor]", model_state), None
            train_state["optimizer"] = optim_state
        args = (self.dir, step, weights, train_state, self.cfg.checkpoint.keep)
        kwargs: dict[str, Any] = dict(
            sharded_state=sharded, world=self.world, before_write=self.faults.writing_checkpoint
        )
        if self.cfg.checkpoint.async_save:
            self._stager = self._stager or host_stager(self.world.device)
            path, future = save_checkpoint_async(*args, stager=self._stager, group=self._write_group, **kwargs)
            self._writing = (path, future)
            return path
        path = save_checkpoint(*args, **kwargs)
        self._saved(path)
        return path

    def wait(self) -> None:
        """Return once the checkpoint being written in the background, if any, is complete; raise
        if its write failed on any rank. Every rank calls it where it calls ``save``, together."""
        if self._writing is None:
            return
        path, future = self._writing
        self._writing = None
        error = future.exception()
        # Also a barrier: no rank reads the checkpoints before the main rank has completed this one.
        (failed,) = self.world.agree(error is not None)
        if failed:
            raise write_failed(path, error) from error
        self._saved(path)

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """The block (the training loop) ends only once the checkpoint being written in the
        background, if any, is complete; then the host copy of the state is freed."""
        try:
            yield
        except BaseException:
            # Other ranks may be inside a collective of the step that failed here: this rank
            # finishes its own part without them, and tells of a failed write beside the error.
            if self._writing is not None:
                path, future = self._writing
                self._writing = None
                if (error := future.exception()) is not None:
                    print(f"kiln: {path}: writing the checkpoint in the background failed: {error}", file=sys.stderr)
            raise
        else:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _saved(self, path: Path) -> None:
        if not self._holding:  # a probe's checkpoint (see hold) is put back: nothing to tell
            self._say(f"kiln: saved checkpoint {path}")

    def hold(self) -> dict[str, Any]:
        """The run's whole state (this rank's shards), copied to host memory, for ``put_back``
        after work that must leave no trace. Unlike a checkpoint it keeps an optimizer that has
        not stepped yet exactly so: saving one initialises its state."""
        self._holding = True
        return {
            "model": [local_part(t).detach().cpu().clone() for t in self.model.state_dict().values()],
            "optimizer": {
                param: {k: local_part(v).detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
                for param, state in self.optimizer.state.items()
            },
            "parts": copy.deepcopy({name: part.state_dict() for name, part in self.parts.items()}),
            "rng": capture_rng(),
        }

    @torch.no_grad()
    def put_back(self, held: dict[str, Any]) -> None:
        """Restore what ``hold`` copied, in place."""
        self.wait()  # a checkpoint being written while held says nothing either
        self._holding = False
        for target, saved in zip(self.model.state_dict().values(), held["model"], strict=True):
            local_part(target).copy_(saved)
        if not held["optimizer"]:  # it had not stepped: it starts afresh again
            self.optimizer.state.clear()
        for param, state in held["optimizer"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    local_part(self.optimizer.state[param][key]).copy_(value)
                else:
                    self.optimizer.state[param][key] = value
        for name, part in self.parts.items():
            part.load_state_dict(held["parts"][name])
        restore_rng(held["rng"])

    def discard(self, path: Path) -> None:
        """Delete checkpoint ``path`` once every rank is done with it."""
        self.wait()
        self.world.barrier()
        if self.world.is_main:
            shutil.rmtree(path)
        self.world.barrier()

    def resume(self) -> int | None:
        """The step the run resumes at, per ``checkpoint.resume``, everything restored; None if fresh."""
        self.wait()
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            if list_checkpoints(self.dir):
                raise FileExistsError(
                    f"run.dir {self.cfg.run.dir} already holds checkpoints and checkpoint.resume is 'never'; "
                    "choose another run.dir or set checkpoint.resume=auto"
                )
            return None
        path = self.latest() if resume == "auto" else Path(resume)
        if path is None:
            return None
        step = self.load(path)
        self._say(f"kiln: resumed from {path} at step {step}")
        self._branch_at(step)
        return step

    def _branch_at(self, step: int) -> None:
        """A run resumed from an older checkpoint than its newest trains a new branch: the later
        checkpoints, of the branch left behind, are set aside, so that the rotation keeps this
        branch's newest and a later ``--resume auto`` goes on with it."""
        if self.world.is_main and (moved := set_aside_after(self.dir, step)):
            aside, later = moved
            names = ", ".join(p.name for p in later)
            self._say(f"kiln: a new branch from step {step}: the later checkpoints ({names}) are set aside in {aside}")
        self.world.barrier()

    def load(self, path: Path) -> int:
        """Restore model, optimizer, every part and the RNG from ``path``; its step."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, set_state_dict

        self.wait()
        stored, train_state = open_checkpoint(path)
        try:
            if stored is None:  # sharded: DCP fills this process's own layout, resharding as needed
                model_state, optim_state = get_state_dict(self.model, self.optimizer, options=_options(True))
                state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
                load_sharded(path, state)
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optimizer"],
                    options=_options(True),
                )
            else:  # a whole model's checkpoint, of which this rank reads and keeps what it holds
                optim_state = self.load_whole(stored, train_state["optimizer"])
                set_optimizer_state_dict(self.model, self.optimizer, optim_state, options=_options(False))
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{path}: the checkpoint does not fit this model (was [model] changed?); use a new run.dir "
                f"or --resume never. {str(e).splitlines()[0][:300]}"
            ) from None
        for name, part in self.parts.items():
            if name in train_state:
                part.load_state_dict(train_state[name])
        restore_rng(train_state["rng"])
        return train_state["step"]


def _options(sharded: bool) -> StateDictOptions:
    """How model and optimizer state are laid out in a checkpoint. Sharded optimizer state is
    flat, one entry per parameter and setting ("param_groups.blocks.3.attn.wq.weight.lr"), so
    ranks that hold different layers never write the same key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=sharded)
