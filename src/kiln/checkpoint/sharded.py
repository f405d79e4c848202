"""Reading sharded checkpoints (``torch.distributed.checkpoint``): into a model's own layout, or
whole in one process a few tensors at a time, which lets ``kiln export`` write a model that no
process could hold. What DCP unpickles is read as data only: the metadata by an unpickler that
knows DCP's own record types and nothing else, the non-tensor entries by torch's weights-only
loader, so a checkpoint from elsewhere cannot run code as it loads."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from kiln.checkpoint.store import SHARDED_DIR, CheckpointError

METADATA_FILE = ".metadata"  # the name FileSystemWriter gives a checkpoint's metadata
_RECORDS = "torch.distributed.checkpoint.metadata"  # the module of DCP's metadata classes
_ALSO = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided and the other layouts pickle as a call to it
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each chunk lies in which file
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            found = getattr(__import__(module, fromlist=[name]), name, None) if module in ("torch", _RECORDS) else None
            if module == _RECORDS and isinstance(found, type) and found.__module__ == _RECORDS:
                return found
            if module == "torch" and isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
            if (module, name) in _ALSO:
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class ShardReader(FileSystemReader):
    """DCP's reader of the sharded checkpoint in ``path`` (its ``state/``), whose metadata is
    checked to be DCP's records only before DCP unpickles it, and read once: a model read in many
    parts does not read it at each."""

    _kept: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._kept is None:
            path = Path(self.path) / METADATA_FILE
            try:
                with open(path, "rb") as f:
                    _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"{path}: holds a reference to {e}, which a checkpoint's metadata never holds; refused, "
                    "since loading it could run code"
                ) from None
            except (OSError, EOFError, ValueError) as e:
                raise CheckpointError(f"{path}: not a readable sharded checkpoint ({e})") from None
            self._kept = super().read_metadata(*args, **kwargs)
        return self._kept


class _PlainData(DefaultLoadPlanner):
    """DCP's load planner, with the checkpoint's non-tensor entries (the optimizer's settings)
    read by torch's weights-only loader: numbers, strings and their containers, never code."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            data = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"the sharded checkpoint's entry {read_item.dest_index.fqn} is not plain data; refused, "
                "since loading it could run code"
            ) from None
        plain = io.BytesIO()
        torch.save(data, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def load_sharded(path: str | os.PathLike, state: dict[str, Any], reader: ShardReader | None = None) -> None:
    """Fill ``state`` (e.g. ``{"model": model.state_dict()}``; any subset of what was saved, in
    this process's own sharding or none) in place from the sharded checkpoint ``path`` (through
    ``reader``, a ``ShardReader`` of it, when given)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = reader or ShardReader(str(Path(path) / SHARDED_DIR))
    reader.read_metadata()  # checked here, so that a refusal is told as itself
    try:
        with warnings.catch_warnings():
            # Without a process group (eval, generate, export, a 1-process resume) this one process
            # reads all, as meant: DCP warns that it assumes so.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=_PlainData(), no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError, ValueError) as e:
        failures = e.failures.values() if isinstance(e, CheckpointException) else ()
        for refused in (error for error, _ in failures if isinstance(error, CheckpointError)):
            raise CheckpointError(f"{path}: {refused}") from None
        raise CheckpointError(
            f"{path}: the sharded checkpoint does not fit this model (was [model] changed?): "
            f"{str(e).splitlines()[0][:300]}"
        ) from None


class ShardedModel:
    """The model tensors of the sharded checkpoint ``path`` (a complete one), by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = ShardReader(str(self.path / SHARDED_DIR))
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
