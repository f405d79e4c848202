"""Files written whole or not at all: the one atomic writer that data, checkpoints, the memory
ladder and the metrics sinks share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
