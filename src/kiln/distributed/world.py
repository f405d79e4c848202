"""The one object that knows the process group: ranks, the device of this rank, the device mesh.

``kiln train`` under ``torchrun`` (or ``kiln launch``) finds RANK, WORLD_SIZE and LOCAL_RANK in
the environment and joins the group itself: NCCL on CUDA, gloo on CPU. The world is one
DeviceMesh over named dimensions, outermost first:

- ``pp``: pipeline stages;
- ``dp_replicate``: replicas of FSDP's shards (HSDP: FSDP within a group, replicas across groups);
- ``dp_shard``: the ranks FSDP shards the model over (every data-parallel rank under plain FSDP);
- ``cp``: context parallelism, the ranks that split one batch's sequences;
- ``tp``: tensor parallelism, innermost, so that a tensor-parallel group is the closest ranks.

Expert parallelism is a view of the data-parallel ranks: with ``ep`` > 1, ``dp_shard`` is cut in
two (``dp_shard_out`` x ``dp_shard_in``), and the experts are split over ``dp_shard_in`` x ``cp``
(``ep`` ranks) and sharded by FSDP over the rest. Every group is a submesh of this mesh, or a
flattening of some of its dimensions (``dp``: every data-parallel rank; ``dp_shard_cp``: what
FSDP shards over; ``ep``; ``ep_shard``). Nothing else builds a mesh or computes a rank. In a
single process (no torchrun) the world is one rank and no process group exists, so everything
here is a no-op and nothing distributed is imported. The world's hang watchdog
(``kiln.distributed.watchdog``) starts with the process group and sets its timeouts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from kiln.config import ConfigError, ParallelConfig, parse_duration
from kiln.device import resolve_device
from kiln.distributed.watchdog import Watchdog, set_collective_env


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    device: torch.device = torch.device("cpu")
    # The one DeviceMesh (see the module's docstring) when size > 1, or once made for a single
    # process (``mesh_of_one``).
    mesh: Any = None
    control_group: Any = None  # a gloo group for host-side agreement
    watchdog: Watchdog = field(default_factory=Watchdog)  # the loop's beats go here

    @property
    def dp(self) -> int:
        """Data-parallel ranks: every rank that holds the same part of the model (replicas,
        shards and context-parallel ranks alike)."""
        return self.size // (self.tp * self.pp)

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks FSDP shards over within one replica, context parallelism's aside."""
        return self.dp // (self.dp_replicate * self.cp)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp

    @property
    def data_ranks(self) -> int:
        """The ranks that read different batches: the data-parallel ranks, over context parallelism's."""
        return self.dp // self.cp

    @property
    def data_rank(self) -> int:
        """Which batch this rank reads (the ranks of one context-parallel group read the same)."""
        return self.dp_rank // self.cp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def group(self, name: str) -> Any:
        """The process group of the mesh dimension, or flattened dimensions, ``name`` (see the
        module's docstring) that this rank belongs to."""
        return self.mesh[name].get_group()

    def fsdp_mesh(self, experts: bool = False) -> Any:
        """The mesh FSDP lays shards out on: ``dp_shard_cp``, with ``dp_replicate`` outside it
        for HSDP (a 2-D mesh: replicated, sharded). ``experts``: that of the experts, split
        over ``ep`` and sharded over the other data-parallel ranks (``ep_shard``)."""
        mesh = self.mesh if self.mesh is not None else self.mesh_of_one()
        shard = "ep_shard" if experts else "dp_shard_cp"
        return mesh["dp_replicate", shard] if self.dp_replicate > 1 else mesh[shard]

    def pipeline_ends(self) -> list[tuple[int, int]]:
        """The first and the last pipeline stage's ranks that hold the same place on every other
        dimension, for each such place (the ranks that hold the two copies of a tied weight)."""
        grid = self.mesh.mesh
        return [(int(a), int(b)) for a, b in zip(grid[0].flatten(), grid[-1].flatten(), strict=True)]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            # Naming the device keeps NCCL from guessing one (and warning about it).
            kwargs: dict[str, Any] = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
            dist.barrier(**kwargs)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The average of ``value`` over all ranks (one all-reduce; the value itself if alone)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.size

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag made true on every rank if it is true on any (a stop signal, a time budget
        hit): decisions that change which collectives run next must be the same everywhere.
        Done over a gloo group on the host, so a GPU run does not wait for its device here."""
        return tuple(bool(v) for v in self.largest(*map(float, flags)))

    def largest(self, *values: float) -> tuple[float, ...]:
        """Each host-side value replaced by its maximum over the ranks (over the gloo group)."""
        if not self.distributed:
            return values
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control_group)
        return tuple(tensor.tolist())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's host-side ``value`` (anything picklable), in rank order (over the gloo group)."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.control_group)
        return values

    def dp_total(self, count: int) -> int:
        """The sum of a host-side count over the ranks that read different batches (the ranks of
        one tensor- or context-parallel group, and the stages of one pipeline, hold the same batch
        and count once), over the gloo group on the host."""
        if not self.distributed:
            return count
        import torch.distributed as dist

        value = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(value, group=self.control_group)
        return int(value.item()) // (self.tp * self.pp * self.cp)

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a tensor on this rank's device) summed in place over the data-parallel ranks
        that hold the same part of the model as this one (one all-reduce, on the device)."""
        if self.dp > 1:
            import torch.distributed as dist

            dist.all_reduce(value, group=self.group("dp"))
        return value

    def mesh_of_one(self) -> Any:
        """The mesh, made for a single process on first use: FSDP needs a process group even
        alone, to keep a model's state in CPU memory (``parallel.cpu_offload``)."""
        global _OWN_GROUP
        if self.mesh is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                _OWN_GROUP = True
                atexit.register(close_world)
            self.mesh = build_mesh(self.device.type, dict.fromkeys(MESH_DIMS, 1))
        return self.mesh

    def each(self, work: Callable[[], T], what: str) -> list[T]:
        """Every rank runs its own ``work()`` (which must not use the process group); every rank's
        result, in rank order, once all are done (kiln.data.team.Team).

        However long one rank takes (preparing its share of the data, say), no collective waits
        long: every ``HEARTBEAT_S`` each rank, from a thread beside its work, meets the others in a
        small host-side agreement that says who is still working and whether one failed, so the
        process group's timeout never runs out. A node's first rank, once done, says every minute
        how long it has waited; if any rank's work fails, the others stop with an error naming it.
        """
        if not self.distributed:
            return [work()]
        finished = threading.Event()
        outcome: list[bool] = []
        others_failed: list[int] = []

        def heartbeat() -> None:
            started = said = 0.0
            while True:
                finished.wait(HEARTBEAT_S)
                done = finished.is_set()
                failed = done and outcome != [True]
                # The highest working rank + 1 (0: all done) and the highest failed rank + 1.
                working, failing = self.largest(0 if done else self.rank + 1, self.rank + 1 if failed else 0)
                if failing:
                    others_failed.append(int(failing) - 1)
                    return
                if not working:
                    return
                if done and self.local_rank == 0:
                    now = time.monotonic()
                    if not started:
                        started = said = now
                    elif now - said >= 60:
                        waited = f"{now - started:.0f}s"
                        print(f"kiln: rank {self.rank} waiting for other ranks ({what}): {waited}", file=sys.stderr)
                        said = now

        beats = threading.Thread(target=heartbeat, name="kiln-each", daemon=True)
        beats.start()
        try:
            result = work()
            outcome.append(True)
        finally:
            finished.set()
            beats.join()
        if others_failed:
            raise RuntimeError(f"rank {others_failed[0]} failed while {what}; its own error says why")
        return self.gather(result)

    def share(self, value: T, src: int) -> T:
        """Rank ``src``'s host-side ``value`` (anything picklable) on every rank (over the gloo group)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box: list[Any] = [value if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.control_group)
        return box[0]


T = TypeVar("T")
# How often the ranks in World.each tell each other who is still working.
HEARTBEAT_S = 2.0
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The dimensions each flattened view of the mesh joins (those a mesh lacks are left out).
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard", "dp_shard_out", "dp_shard_in", "cp"),
    "dp_shard_cp": ("dp_shard", "dp_shard_out", "dp_shard_in", "cp"),
    "ep": ("dp_shard_in", "cp"),
    "ep_shard": ("dp_shard", "dp_shard_out"),
}
_WORLD: World | None = None
_OWN_GROUP = False  # this module started the process group, so it ends it


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def mesh_shape(size: int, *, pp: int, tp: int) -> tuple[int, int, int]:
    """The (pp, dp, tp) shape of a world of ``size`` ranks; ConfigError unless pp x tp divides it."""
    if size % (tp * pp):
        raise ConfigError(
            [
                f"parallel: the world size {size} is not a multiple of parallel.pp x parallel.tp = {pp} x {tp}; "
                "it must be pp x dp x tp ranks"
            ]
        )
    return pp, size // (pp * tp), tp


def mesh_dims(size: int, parallel: ParallelConfig) -> dict[str, int]:
    """The size of each dimension of the mesh of a world of ``size`` ranks laid out as
    ``parallel`` says (see the module's docstring). A context-parallel, replica or expert degree
    that does not divide what it must is left at 1 here: ``parallelize`` refuses the layout,
    naming the key."""
    pp, dp, tp = mesh_shape(size, pp=parallel.pp, tp=parallel.tp)
    cp = parallel.cp if dp % parallel.cp == 0 else 1
    replicate = parallel.dp_replicate if dp % (parallel.dp_replicate * cp) == 0 else 1
    shard, ep = dp // (replicate * cp), parallel.ep
    dims = {"pp": pp, "dp_replicate": replicate}
    if ep > 1 and ep % cp == 0 and shard % (ep // cp) == 0:
        dims |= {"dp_shard_out": shard // (ep // cp), "dp_shard_in": ep // cp}
    else:
        dims["dp_shard"] = shard
    return dims | {"cp": cp, "tp": tp}


def build_mesh(device_type: str, dims: dict[str, int]) -> Any:
    """The world's DeviceMesh of ``dims`` (name: size, outermost first), with its flattened views."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    for name, parts in FLATTENED.items():
        present = tuple(d for d in parts if d in dims)
        if name in ("ep", "ep_shard") and "dp_shard_in" not in dims:
            continue  # no expert parallelism
        _flatten(mesh, present, name)
    return mesh


def _flatten(mesh: Any, dims: tuple[str, ...], name: str) -> None:
    """Make ``mesh[dims]`` one dimension, ``mesh[name]`` from then on. PyTorch has no public way
    to do this: DeviceMesh's ``_flatten`` (torchtitan's ParallelDims uses it too) is the one
    private call; tests/distributed/test_world.py fails if it changes."""
    mesh[dims]._flatten(mesh_dim_name=name)


def init_world(
    device: str = "auto", parallel: ParallelConfig | None = None, run_dir: str | Path | None = None
) -> World:
    """Join the process group described by the torchrun environment (once per process), laid
    out as ``parallel`` says (its pp and tp degrees, its replicas, context- and
    expert-parallel ranks; the rest of the world is data-parallel), watched by the hang
    watchdog with its timeouts (it starts watching with the training loop, and NCCL's own dumps
    on a timeout go to ``run_dir``, if given)."""
    global _WORLD, _OWN_GROUP
    parallel = parallel or ParallelConfig()
    if _WORLD is not None:
        for key in ("tp", "pp"):
            degree = getattr(parallel, key)
            if getattr(_WORLD, key) != degree:
                raise ConfigError(
                    [f"parallel.{key}: this process already runs with {key}={getattr(_WORLD, key)}, not {degree}"]
                )
        return _WORLD
    size = int(os.environ.get("WORLD_SIZE", "1")) if in_torchrun() else 1
    rank = int(os.environ.get("RANK", "0")) if in_torchrun() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if in_torchrun() else 0
    dims = mesh_dims(size, parallel)
    dev = resolve_device(device)
    if size == 1:
        _WORLD = World(device=dev)
        return _WORLD
    import torch.distributed as dist

    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError([f"run.device: LOCAL_RANK {local_rank} has no GPU ({torch.cuda.device_count()} visible)"])
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    watchdog = Watchdog(rank, size, parse_duration(parallel.init_timeout), parse_duration(parallel.train_timeout))
    if not dist.is_initialized():
        set_collective_env(run_dir, nccl=dev.type == "cuda")  # read when the group is made
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=watchdog.collective_timeout())
        _OWN_GROUP = True
        atexit.register(close_world)
    mesh = build_mesh(dev.type, dims)
    control = dist.new_group(backend="gloo") if dev.type == "cuda" else None
    flattened = [mesh[name].get_group() for name in FLATTENED if name in ("dp", "dp_shard_cp") or "dp_shard_in" in dims]
    watchdog.watch_groups([None, *mesh.get_all_groups(), *flattened, control])  # None: the default group
    _WORLD = World(
        rank=rank,
        local_rank=local_rank,
        size=size,
        tp=dims["tp"],
        pp=dims["pp"],
        cp=dims["cp"],
        dp_replicate=dims["dp_replicate"],
        ep=parallel.ep if "dp_shard_in" in dims else 1,
        device=dev,
        mesh=mesh,
        control_group=control,
        watchdog=watchdog,
    )
    return _WORLD


def close_world() -> None:
    """Leave the process group (at exit, or explicitly when a script is done with it)."""
    global _WORLD, _OWN_GROUP
    if _WORLD is not None:
        _WORLD.watchdog.stop()
    _WORLD = None
    if _OWN_GROUP:
        import torch.distributed as dist

        if dist.is_initialized():
            _meet_before_leaving()
            dist.destroy_process_group()
        _OWN_GROUP = False


# How long a rank leaving the group waits for the others at the door (a rank that failed never comes).
LEAVE_WAIT_S = 5.0


def _meet_before_leaving() -> None:
    """Gloo sends asynchronously: a rank that tears its connections down while a peer is still
    taking in its last messages aborts that peer's process ("terminate called without an active
    exception", SIGABRT at exit). Meeting the others first lets every message land."""
    import torch.distributed as dist

    if dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return  # NCCL's destroy_process_group waits for its own pending work
    from datetime import timedelta

    with contextlib.suppress(RuntimeError):  # a rank that is gone or late: leave anyway
        dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_WAIT_S))
