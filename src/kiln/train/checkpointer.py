"""What a checkpoint of a run holds, when the loop saves one, and how a run resumes from it.

A checkpoint is the model and optimizer (keyed by parameter name, so any strategy or world size
can load it; each rank's shards when sharded) and one dict of the loop's stateful parts, each
saved with its ``state_dict`` and restored with its ``load_state_dict``: precision (the loss
scaler), the memory ladder's rung, the guard. Beside them: the step, the RNG state, the data
position (a pure function of seed and step), the config and the parallel layout.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from kiln.checkpoint import (
    CheckpointError,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_sharded,
    restore_rng,
    save_checkpoint,
)
from kiln.config import Config
from kiln.data.loader import StepBatches
from kiln.distributed.parallelize import is_sharded
from kiln.distributed.world import World


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Checkpointer:
    def __init__(
        self,
        cfg: Config,
        world: World,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        parts: Mapping[str, Stateful],
        batches: StepBatches,
        say: Callable[[str], None],
    ):
        self.cfg, self.world, self.model, self.optimizer = cfg, world, model, optimizer
        self.parts, self.batches, self._say = parts, batches, say
        self.dir = Path(cfg.run.dir) / "checkpoints"
        self.sharded = world.mesh is not None and is_sharded(model)

    def due(self, step: int, now: bool = False) -> bool:
        """Is ``step`` (just done) a checkpoint? ``now``: the run ends or stops here."""
        every = self.cfg.checkpoint.every
        return now or bool(every and step % every == 0)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.dir)

    def save(self, step: int) -> Path:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # Model and optimizer state keyed by parameter name (no "module." of DDP), each rank's
        # shards when sharded: so any strategy or world size can load it back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        train_state: dict[str, Any] = {
            "step": step,
            **{name: part.state_dict() for name, part in self.parts.items()},
            "rng": capture_rng(),
            # The data order is a pure function of (seed, step): this is the whole position.
            "data": self.batches.position(step),
            "config": self.cfg.to_dict(),
            "world": {"size": self.world.size, "tp": self.world.tp, "strategy": self.cfg.parallel.strategy},
        }
        if self.sharded:
            weights, sharded = None, {"model": model_state, "optimizer": optim_state}
        else:
            weights, sharded = model_state, None
            train_state["optimizer"] = optim_state
        path = save_checkpoint(
            self.dir, step, weights, train_state, keep=self.cfg.checkpoint.keep, sharded_state=sharded, world=self.world
        )
        self._say(f"kiln: saved checkpoint {path}")
        return path

    def hold(self) -> dict[str, Any]:
        """The run's whole state (this rank's shards), copied to host memory, for ``put_back``
        after work that must leave no trace. Unlike a checkpoint it keeps an optimizer that has
        not stepped yet exactly so: saving one initialises its state."""
        return {
            "model": [_local(t).detach().cpu().clone() for t in self.model.state_dict().values()],
            "optimizer": {
                param: {k: _local(v).detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
                for param, state in self.optimizer.state.items()
            },
            "parts": copy.deepcopy({name: part.state_dict() for name, part in self.parts.items()}),
            "rng": capture_rng(),
        }

    @torch.no_grad()
    def put_back(self, held: dict[str, Any]) -> None:
        """Restore what ``hold`` copied, in place."""
        for target, saved in zip(self.model.state_dict().values(), held["model"], strict=True):
            _local(target).copy_(saved)
        if not held["optimizer"]:  # it had not stepped: it starts afresh again
            self.optimizer.state.clear()
        for param, state in held["optimizer"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    _local(self.optimizer.state[param][key]).copy_(value)
                else:
                    self.optimizer.state[param][key] = value
        for name, part in self.parts.items():
            part.load_state_dict(held["parts"][name])
        restore_rng(held["rng"])

    def discard(self, path: Path) -> None:
        """Delete checkpoint ``path`` once every rank is done with it."""
        self.world.barrier()
        if self.world.is_main:
            shutil.rmtree(path)
        self.world.barrier()

    def resume(self) -> int | None:
        """The step the run resumes at, per ``checkpoint.resume``, everything restored; None if fresh."""
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
        return step

    def load(self, path: Path) -> int:
        """Restore model, optimizer, every part and the RNG from ``path``; its step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        model_state, train_state = load_checkpoint(path, weights_only=False)
        if model_state is None:  # sharded: DCP fills this process's own layout, resharding as needed
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            load_sharded(path, state)
            model_state, optim_state, full = state["model"], state["optimizer"], False
        else:
            optim_state, full = train_state["optimizer"], True
        try:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_state,
                optim_state_dict=optim_state,
                options=StateDictOptions(full_state_dict=full and self.sharded),
            )
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP, tensor parallel); a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
