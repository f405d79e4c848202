"""Files written whole or not at all: the one atomic writer that data, checkpoints, the memory
ladder and the metrics sinks share; and where a model directory's safetensors weights are (one
file, or several an index names), for whoever reads or writes them."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write via a temp file beside ``path`` and rename, so a killed process never leaves a
    truncated file there; the temp name is unique, so several processes (ranks) may write at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Every file and folder under ``path``, and ``path``, on disk: before a rename makes it
    visible as complete, so that a power loss cannot leave it renamed but empty."""
    for p in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
        (fsync_dir if p.is_dir() else fsync_file)(p)
    fsync_dir(path)


def directory_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (or become) a directory that this process writes into; None if it can.
    Asked before a run starts, so that a bad run.dir is one line, not a traceback minutes later."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{path} is a file, not a directory; choose another path"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{path} is not writable by this user"
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable by this user"
    return None


def weight_files(directory: Path) -> dict[str, list[str]]:
    """The safetensors files of an export or model directory and the tensors each holds (from
    the index when there is one); a missing file named by the index is an error naming both."""
    index = directory / INDEX
    if not index.is_file():
        if not (directory / WEIGHTS).is_file():
            raise FileNotFoundError(f"{directory}: no {WEIGHTS} and no {INDEX}")
        return {WEIGHTS: []}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({e})") from None
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    for file in files:
        if not (directory / file).is_file():
            raise FileNotFoundError(f"{index}: names {file}, which is missing (tensor {files[file][0]!r})")
    return files
