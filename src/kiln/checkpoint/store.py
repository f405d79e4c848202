"""Checkpoints on disk, written so that a crash at any instant leaves either the old set of
checkpoints or the old set plus one complete new one, never a half-written one that looks whole.

Layout of one checkpoint::

    checkpoints/step-00000600/
        model.safetensors   weights (loadable without kiln, e.g. by safetensors or transformers)
        train_state.pt      optimizer, scaler, RNG, step, data position, config
        manifest.json       file sizes and sha256 digests; written last, it marks completeness

A model sharded over ranks (FSDP, tensor parallel) is saved instead with
``torch.distributed.checkpoint`` by every rank into ``state/`` (model and optimizer, one file per
rank plus metadata), which any world size or strategy can load back: DCP reshards on load.

The directory is built under a temporary name, every file and the directory are fsynced, and
only then is it renamed to ``step-XXXXXXXX``: rename is atomic on POSIX file systems. With
several ranks, the main rank creates, finishes and renames it, and barriers keep the others in
step (the run directory must be on storage every rank sees).

``save_checkpoint_async`` does the same in a background thread, from a copy of the state in host
memory; its temporary directory becomes a checkpoint only when every rank's part is written, so
a process killed meanwhile leaves the previous checkpoint the newest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from kiln.io import fsync_dir, fsync_tree

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
SHARDED_DIR = "state"
PREFIX = "step-"


class CheckpointError(RuntimeError):
    pass


class Stateful(Protocol):
    """A part of the training state that checkpoints keep (the loop's components, a job's own)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dedupe_shared(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings): store each storage once
    and remember the other names as aliases."""
    by_storage: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in by_storage:
            aliases[name] = by_storage[key]
        else:
            by_storage[key] = name
            unique[name] = t.detach().contiguous().cpu()
    return unique, aliases


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor] | None,
    train_state: dict[str, Any],
    keep: int | None = None,
    *,
    sharded_state: dict[str, Any] | None = None,
    world=None,
    before_write: Callable[[], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; then keep only the newest ``keep``.

    Either ``model_state`` (complete weights, written as safetensors by the main rank) or
    ``sharded_state`` (this rank's shards of whatever it holds, written by every rank with DCP).
    With a ``world`` of several ranks every rank must call this. ``before_write`` runs before the
    main rank writes its files (a test's slow disk)."""
    tmp, final = _begin(root, step, world)
    if sharded_state is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(sharded_state, checkpoint_id=str(tmp / SHARDED_DIR))
    if world is not None:
        world.barrier()
    error: OSError | None = None
    if world is None or world.is_main:
        try:
            _commit(tmp, final, model_state, train_state, keep, before_write)
        except OSError as e:  # a full disk, say: the checkpoints before this one stay as they were
            error = e
    # Also the barrier after the write: every rank learns whether it failed.
    (failed,) = world.agree(error is not None) if world is not None else (error is not None,)
    if failed:
        raise write_failed(final, error)
    return final


def write_failed(final: Path, error: BaseException | None) -> CheckpointError:
    """The error of a checkpoint whose files could not be written (``error``: on this rank; None:
    on another), saying which earlier checkpoint is intact and how to go on."""
    why = "another rank could not write its part (see its error)"
    if error is not None:
        why = (error.strerror if isinstance(error, OSError) else None) or str(error)
    full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    before = latest_checkpoint(final.parent)
    intact = f"the checkpoint before it, {before}, is intact" if before else "no earlier checkpoint is there"
    then = "make room and run the same command to resume" if full else "the same command resumes from it"
    return CheckpointError(f"{final}: not written: {why}; {intact}: {then}")


def host_stager(device: torch.device):
    """Host memory for ``save_checkpoint_async`` to copy a state into. Kept from save to save it
    reuses its buffers, so only the first save allocates them (pinned when the state is on a GPU,
    for fast copies); ``close()`` frees them. Copies are made by storage, so tied weights stay one
    tensor, as in the synchronous save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=device.type == "cuda",
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def save_checkpoint_async(
    root: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor] | None,
    train_state: dict[str, Any],
    keep: int | None = None,
    *,
    stager,
    sharded_state: dict[str, Any] | None = None,
    world=None,
    group=None,
    before_write: Callable[[], None] | None = None,
) -> tuple[Path, Future[None]]:
    """``save_checkpoint`` in a background thread: the caller only waits while the state is
    copied into ``stager`` (a ``host_stager``), so training may change it meanwhile; the next
    save given the same stager must wait for this one. Returns the checkpoint's path and the
    future of this rank's part of the write, which raises what the write raised.

    The checkpoint is complete (``latest_checkpoint`` finds it) once the main rank's future is
    done: its write commits only after DCP has gathered every rank's result. A sharded write
    coordinates over ``group``, a process group of its own (gloo): on one the training thread
    uses, its collectives would pair up with training's in another order on each rank."""
    tmp, final = _begin(root, step, world)
    is_main = world is None or world.is_main
    staged = stager.stage({"model": model_state, "train": train_state}) if is_main else None
    shards = None
    if sharded_state is not None:
        import torch.distributed.checkpoint as dcp

        # A stager without async staging (``host_stager``) stages in place: async_save returns a plain Future.
        shards = cast(
            "Future[Any]",
            dcp.async_save(
                sharded_state, checkpoint_id=str(tmp / SHARDED_DIR), process_group=group, async_stager=stager
            ),
        )

    def write() -> None:
        if shards is not None:
            shards.result()
        if is_main:
            assert staged is not None  # staged on the main rank
            _commit(tmp, final, staged["model"], staged["train"], keep, before_write)

    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-checkpoint")
    # Its thread is joined at interpreter exit, so a process that ends while writing finishes first.
    future = writer.submit(write)
    writer.shutdown(wait=False)
    return final, future


def _begin(root: str | os.PathLike, step: int, world) -> tuple[Path, Path]:
    """The temporary directory of checkpoint ``step``, made by the main rank; and its final path."""
    root = Path(root)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    if world is None or world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        # One writer per run directory: leftovers of a writer that was killed are garbage (a
        # directory being written, or one being replaced by a re-save of its step).
        for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    if world is not None:
        world.barrier()
    return tmp, final


def _commit(
    tmp: Path,
    final: Path,
    model_state: dict[str, torch.Tensor] | None,
    train_state: dict[str, Any],
    keep: int | None,
    before_write: Callable[[], None] | None,
) -> None:
    """The main rank's part: its files, then the manifest, the rename that makes the checkpoint
    complete, and the rotation (which never deletes the newest, the one just completed). Files
    that cannot be written (a full disk) leave nothing: the temporary directory goes, its room
    given back, and the error is raised."""
    from safetensors.torch import save_file

    root, step = final.parent, checkpoint_step(final)
    try:
        if before_write is not None:
            before_write()
        if model_state is not None:
            tensors, aliases = dedupe_shared(model_state)
            save_file(tensors, str(tmp / MODEL_FILE), metadata={"aliases": json.dumps(aliases), "step": str(step)})
        torch.save(train_state, tmp / STATE_FILE)
        files = {
            str(f.relative_to(tmp)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file())
        }
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files, "complete": True}, indent=2))
        fsync_tree(tmp)  # all of it on disk before the rename makes it a checkpoint
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        old = root / f".old-{PREFIX}{step:08d}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)
    if keep is not None:
        for stale in list_checkpoints(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)


def _is_complete(path: Path, verify_digests: bool = False) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, info in manifest["files"].items():
            f = path / name
            if f.stat().st_size != info["bytes"]:
                return False
            if verify_digests and _sha256(f) != info["sha256"]:
                return False
        return bool(manifest.get("complete"))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint directory (``step-00000600``) holds."""
    return int(checkpoint.name[len(PREFIX) :])


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first. Partial or temporary ones are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and _is_complete(p):
            found.append((checkpoint_step(p), p))
    return [p for _, p in sorted(found)]


def set_aside_after(root: str | os.PathLike, step: int) -> tuple[Path, list[Path]] | None:
    """Move the complete checkpoints under ``root`` later than ``step`` into
    ``root/abandoned-TIME/``: a branch of the run left behind by a resume from ``step``, kept for
    whoever wants it, never resumed or rotated as the branch trained now. The directory and the
    checkpoints moved; None when there were none."""
    root = Path(root)
    later = [p for p in list_checkpoints(root) if checkpoint_step(p) > step]
    if not later:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = root / f"abandoned-{stamp}", 1
    while aside.exists():  # two branches in one second
        n += 1
        aside = root / f"abandoned-{stamp}-{n}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    fsync_dir(root)
    return aside, later


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


class StoredWeights(Mapping[str, torch.Tensor]):
    """A whole-model checkpoint's weights, each read from its file when asked for: whoever keeps
    only a slice of each (a rank of a sharded run) never holds more than one whole tensor. A
    weight saved under two names (tied) is stored once; ``key`` gives its stored name."""

    def __init__(self, file: Path):
        from safetensors import safe_open

        self.file = file
        with safe_open(str(file), framework="pt") as f:
            self.stored = list(f.keys())  # noqa: SIM118 (safe_open is not a Mapping)
            self.aliases: dict[str, str] = json.loads((f.metadata() or {}).get("aliases", "{}"))
        self._names = set(self.stored)

    def key(self, name: str) -> str:
        """The name ``name``'s tensor is stored under."""
        return self.aliases.get(name, name)

    def __contains__(self, name: object) -> bool:
        # Mapping's own test would read the tensor.
        return isinstance(name, str) and self.key(name) in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self:
            raise KeyError(name)
        with safe_open(str(self.file), framework="pt") as f:
            return f.get_tensor(self.key(name))

    def __iter__(self) -> Iterator[str]:
        return iter([*self.stored, *self.aliases])

    def __len__(self) -> int:
        return len(self.stored) + len(self.aliases)

    def read(self) -> dict[str, torch.Tensor]:
        """Every weight, read at once (the file opened once); a tied weight is one tensor under
        each of its names."""
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in self.stored}
        return {name: tensors[self.key(name)] for name in self}


def open_checkpoint(path: str | os.PathLike) -> tuple[StoredWeights | None, dict[str, Any]]:
    """Like ``load_checkpoint(path, with_state=True)``, with the weights read on access and the
    training state mapped from its file rather than read: a rank that keeps only its slices of a
    whole model's checkpoint reads no other tensor, and only its slices' pages of the optimizer
    state are read in."""
    path = _verified(path)
    weights = StoredWeights(path / MODEL_FILE) if (path / MODEL_FILE).is_file() else None
    return weights, _training_state(path, mmap=True)


def load_checkpoint(
    path: str | os.PathLike, *, with_state: bool = False
) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    """Return ``(model_state, train_state)`` after checking every digest in the manifest.

    ``model_state`` is None for a sharded checkpoint: pass its layout to ``load_sharded``.
    Without ``with_state`` only the weights are read (``train_state`` is None)."""
    path = _verified(path)
    model_state = StoredWeights(path / MODEL_FILE).read() if (path / MODEL_FILE).is_file() else None
    return model_state, _training_state(path) if with_state else None


def _training_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """``train_state.pt`` read by torch's weights-only unpickler: tensors, numbers, strings and
    the containers of them are all kiln writes there, so a file that holds anything else (a
    pickle that would call a function as it loads) is refused instead of run. numpy's arrays are
    let in as data for the checkpoints kiln wrote before its RNG state became a list."""
    import pickle

    rebuild = np.zeros(0).__reduce__()[0]  # numpy's array rebuilder, wherever this numpy keeps it
    arrays: list[Any] = [rebuild, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(arrays):
            return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"a reference to {found[1]}" if found else "an object other than tensors, numbers and strings"
        raise CheckpointError(
            f"{path / STATE_FILE}: holds {what}, which kiln never writes there; refused, since "
            "loading it could run code"
        ) from None


def _verified(path: str | os.PathLike) -> Path:
    """``path``, a checkpoint whose files all match its manifest; CheckpointError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not _is_complete(path, verify_digests=True):
        raise CheckpointError(f"{path}: checkpoint is incomplete or corrupted (manifest does not match its files)")
    return path


def capture_rng() -> dict[str, Any]:
    kind, keys, position, has_gauss, gauss = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state = {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), position, has_gauss, gauss),  # builtins: see _training_state
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
