"""Atomic checkpoints: save (also in the background), find the newest complete one, load, and RNG state capture."""

from kiln.checkpoint.sharded import load_sharded
from kiln.checkpoint.store import (
    CheckpointError,
    Stateful,
    capture_rng,
    checkpoint_step,
    host_stager,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    open_checkpoint,
    restore_rng,
    save_checkpoint,
    save_checkpoint_async,
    set_aside_after,
    write_failed,
)

__all__ = [
    "CheckpointError",
    "Stateful",
    "capture_rng",
    "checkpoint_step",
    "host_stager",
    "list_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "load_sharded",
    "open_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "save_checkpoint_async",
    "set_aside_after",
    "write_failed",
]
