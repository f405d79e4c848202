"""The model of a sharded checkpoint read whole in one process, a few tensors at a time: what
lets ``kiln export`` write a model that no process could hold."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from kiln.checkpoint.store import SHARDED_DIR, CheckpointError, load_sharded


class _MetadataOnce(FileSystemReader):
    """DCP reads a checkpoint's metadata (every tensor's and optimizer state's chunks) at each
    load; a model read in many parts reads it once."""

    _kept: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._kept is None:
            self._kept = super().read_metadata(*args, **kwargs)
        return self._kept


class ShardedModel:
    """The model tensors of the sharded checkpoint ``path`` (a complete one), by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _MetadataOnce(str(self.path / SHARDED_DIR))
        # DCP flattens the saved {"model": {...}, "optimizer": {...}} into dotted names.
        self.tensors = {
            name.removeprefix("model."): (torch.Size(meta.size), meta.properties.dtype)
            for name, meta in self.reader.read_metadata().state_dict_metadata.items()
            if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)
        }

    def empty(self, names: list[str], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Tensors of the shapes and dtypes ``names`` were saved in, on ``device``, not read (their
        values unset; on ``meta``, shapes only)."""
        for name in names:
            if name not in self.tensors:
                raise CheckpointError(
                    f"{self.path}: the sharded checkpoint has no tensor {name!r} (was [model] changed?)"
                )
        return {name: torch.empty(self.tensors[name][0], dtype=self.tensors[name][1], device=device) for name in names}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The whole tensors ``names``, in the dtype they were saved in."""
        state = self.empty(names)
        if state:
            load_sharded(self.path, {"model": state}, self.reader)
        return state
