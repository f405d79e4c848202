"""Weights in safetensors files of a bounded size, written one tensor at a time and read back.

A model larger than ``max_shard_size`` is split the way ``transformers`` splits it
(``model-00001-of-00003.safetensors`` ... and ``model.safetensors.index.json``, whose
``weight_map`` names each tensor's file); a smaller one is one ``model.safetensors``. Every name,
shape and dtype is known before the first byte is written (a ``Layout``), so each file's header
goes first and the tensors follow as they come: the writer never holds more than the tensor it is
given, which is what lets a model that fits in no one process be exported from its shards.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from torch import nn

from kiln.io import INDEX, WEIGHTS, weight_files

DEFAULT_MAX_SHARD_SIZE = "5GB"

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """Bytes in 5000000, "5GB", "500MB" or "2GiB" (decimal units as in ``transformers``); ValueError otherwise."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
        if not match:
            raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
        size = int(float(match[1]) * _UNITS[match[2] or ""])
    if size <= 0:
        raise ValueError(f"not a size: {text!r} (it must be positive)")
    return size


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Layout:
    """Which file each tensor goes to, in the order they will be written."""

    files: list[list[Entry]] = field(default_factory=list)

    @classmethod
    def plan(cls, entries: list[Entry], max_shard_size: int) -> Layout:
        """Tensors in order, a new file whenever the next one would pass ``max_shard_size`` (a tensor
        larger than that gets a file of its own, as in ``transformers``)."""
        layout, size = cls(), 0
        for entry in entries:
            if entry.dtype not in _DTYPES:
                raise ValueError(f"{entry.name}: safetensors has no dtype {entry.dtype}")
            if not layout.files or (size + entry.nbytes > max_shard_size and layout.files[-1]):
                layout.files.append([])
                size = 0
            layout.files[-1].append(entry)
            size += entry.nbytes
        return layout

    def file_name(self, index: int) -> str:
        return WEIGHTS if len(self.files) == 1 else f"model-{index + 1:05d}-of-{len(self.files):05d}.safetensors"


class StreamWriter:
    """Writes a ``Layout``'s tensors, given one at a time in its order, into ``directory``; ``close``
    writes the index (for several files) and checks that every tensor came. Each tensor's sha256
    is kept (``digests``), to verify the files afterwards (``verify``)."""

    def __init__(self, directory: Path, layout: Layout, metadata: Mapping[str, str] | None = None):
        self.directory, self.layout = directory, layout
        self.metadata = {"format": "pt", **(metadata or {})}
        self.digests: dict[str, str] = {}
        self._order: Iterator[tuple[int, Entry]] = ((i, e) for i, entries in enumerate(layout.files) for e in entries)
        self._file_index = -1
        self._file: BinaryIO | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index, entry = next(self._order, (-1, None))
        if entry is None or entry.name != name:
            raise RuntimeError(f"export: tensor {name!r} written out of the planned order (expected {entry})")
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise RuntimeError(
                f"export: tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, planned {entry.shape} {entry.dtype}"
            )
        if index != self._file_index:
            self._open(index)
        data = _bytes(tensor)
        self.digests[name] = hashlib.sha256(data).hexdigest()
        assert self._file is not None
        self._file.write(data)

    def _open(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        self._file_index = index
        header: dict[str, object] = {"__metadata__": self.metadata}
        offset = 0
        for entry in self.layout.files[index]:
            header[entry.name] = {
                "dtype": _DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(self.directory / self.layout.file_name(index), "wb")  # noqa: SIM115 (closed in _open/close)
        self._file.write(struct.pack("<Q", len(text)) + text)

    def close(self) -> list[str]:
        """Finish the last file and write the index; the files written."""
        if self._file is not None:
            self._file.close()
            self._file = None
        missing = next(self._order, None)
        if missing is not None:
            raise RuntimeError(f"export: tensor {missing[1].name!r} was planned but never written")
        names = [self.layout.file_name(i) for i in range(len(self.layout.files))]
        if len(names) > 1:
            weight_map = {e.name: self.layout.file_name(i) for i, es in enumerate(self.layout.files) for e in es}
            total = sum(e.nbytes for es in self.layout.files for e in es)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2))
        return names

    def verify(self) -> int:
        """Check the files: ``safetensors`` accepts each one and lists the planned tensors, and every
        tensor's bytes, read back from its file, are those written (their sha256); the number of
        tensors checked. The bytes are read, not mapped: a mapped file would count in this
        process's resident memory, a whole file at a time."""
        from safetensors import safe_open

        for index, entries in enumerate(self.layout.files):
            path = self.directory / self.layout.file_name(index)
            with safe_open(str(path), framework="pt") as f:
                if set(f.keys()) != {e.name for e in entries}:
                    raise RuntimeError(f"export: {path} does not hold the tensors planned for it")
            with open(path, "rb") as f:
                start = 8 + struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(start - 8))
                for entry in entries:
                    begin, end = header[entry.name]["data_offsets"]
                    f.seek(start + begin)
                    digest, left = hashlib.sha256(), end - begin
                    while chunk := f.read(min(1 << 24, left)):
                        digest.update(chunk)
                        left -= len(chunk)
                    if left or digest.hexdigest() != self.digests[entry.name]:
                        raise RuntimeError(f"export: {entry.name!r} reads back otherwise than it was written")
        return len(self.digests)


def write_weights(
    directory: Path, state: Mapping[str, torch.Tensor], max_shard_size: int, metadata: Mapping[str, str] | None = None
) -> StreamWriter:
    """``state`` (held whole already) into files of at most ``max_shard_size``; a tensor stored
    under several names (a tied embedding) is written once, under its first."""
    from kiln.checkpoint.store import dedupe_shared

    unique, _ = dedupe_shared(state)
    layout = Layout.plan([Entry(n, tuple(t.shape), t.dtype) for n, t in unique.items()], max_shard_size)
    writer = StreamWriter(directory, layout, metadata)
    for name, tensor in unique.items():
        writer.write(name, tensor)
    writer.close()
    return writer


def read_weights(directory: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``directory``'s safetensors files (only ``names``, when given)."""
    from safetensors import safe_open

    out = {}
    for file in weight_files(directory):
        with safe_open(str(directory / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if names is None or name in names:
                    out[name] = f.get_tensor(name)
    return out


def load_weights(model: nn.Module, directory: Path) -> None:
    """Fill ``model`` from ``directory``'s safetensors files (one, or several with an index): every
    tensor of its state dict must be there (a tied one under any of its names), and nothing else."""
    from kiln.checkpoint.store import CheckpointError

    try:
        state = read_weights(directory)
    except (OSError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    loaded = set(state)
    missing = [m for m in missing if not any(n in loaded for n in names.get(id(_tensor(model, m)), []))]
    if missing or unexpected:
        what = f"has no tensor {missing[0]!r}" if missing else f"has {unexpected[0]!r}, which the model does not"
        raise CheckpointError(f"{directory}: the weights do not fit the model: it {what}")


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), leaf)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as stored (little-endian, row-major), without a copy when contiguous."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data) if flat.numel() else memoryview(b"")
