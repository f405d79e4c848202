"""Atomic checkpoints: save, find the newest complete one, load, and RNG state capture."""

from kiln.checkpoint.store import (
    CheckpointError,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_sharded,
    restore_rng,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "capture_rng",
    "list_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "load_sharded",
    "restore_rng",
    "save_checkpoint",
]
