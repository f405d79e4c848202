"""Straggler detection: the rank that holds a data-parallel job back, named with its host.

In a synchronous job every rank's step takes as long as the slowest rank's (the collectives wait
for it), so the wall time per step says nothing about who is slow. Each rank measures its own
work instead, where it waits for no other rank: loading its batch (host time) and its forward
passes (CUDA events on a GPU, read only at log points, after the meter's sync; host time on the
CPU). At each log point the ranks gather their seconds per step over the gloo group, and a rank
above ``observe.straggler_factor`` x the median of its pipeline stage's ranks for
``observe.straggler_intervals`` intervals in a row is logged once as a "straggler" event. With
FSDP or tensor parallelism the forward pass has collectives of its own, so a slow rank makes its
peers' forward passes look slower too: the ratio shrinks, but the slowest rank stays the slowest.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from kiln.config import ObserveConfig
from kiln.distributed.world import World


class BusyClock:
    """Time this rank spends on its own work: ``host()`` blocks by the host's clock,
    ``device()`` blocks by CUDA events on a GPU (by the host's clock elsewhere)."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def device(self) -> Iterator[None]:
        if not self.cuda:
            with self.host():
                yield
            return
        # Pairs the device has passed are read now (without waiting), so few stay held.
        while self._events and self._events[0][1].query():
            self._seconds += self._elapsed(*self._events.pop(0))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((start, end))

    def take(self) -> float:
        """The seconds measured since the last take. Reading the events waits for them, so this
        is called after a sync (at a log point)."""
        seconds = self._seconds + sum(self._elapsed(start, end) for start, end in self._events)
        self._seconds, self._events = 0.0, []
        return seconds

    @staticmethod
    def _elapsed(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000


class Stragglers:
    """Owns the busy clock the loop times its work with, and the count of slow intervals in a
    row of each rank. Off (no gathering) in a single process or with ``straggler_factor`` 0."""

    def __init__(self, world: World, observe: ObserveConfig):
        self.world = world
        self.factor, self.intervals = observe.straggler_factor, observe.straggler_intervals
        self.clock = BusyClock(world.device)
        self.host = socket.gethostname()
        self.slow = [0] * world.size

    def review(self, step: int, steps: int, logger: Any) -> None:
        """The log point after ``steps`` steps ending at ``step``: compare the ranks (a
        collective over the gloo group; every rank calls it at the same log points)."""
        seconds = self.clock.take()
        if not self.world.distributed or not self.factor or steps <= 0:
            return
        reports = self.world.gather((self.host, seconds / steps))
        # Pipeline stages do different work: a rank is compared with the ranks of its stage.
        per_stage = self.world.size // self.world.pp
        for rank, (host, step_s) in enumerate(reports):
            peers = [s for r, (_, s) in enumerate(reports) if r // per_stage == rank // per_stage]
            median = statistics.median(peers)
            slow = len(peers) > 1 and median > 0 and step_s > self.factor * median
            self.slow[rank] = self.slow[rank] + 1 if slow else 0
            if self.slow[rank] == self.intervals:
                logger.event(
                    step,
                    "straggler",
                    f"rank {rank} on {host} is a straggler: {step_s:.3g}s of its own work (data and forward) "
                    f"per step, {step_s / median:.1f}x the median rank's {median:.3g}s, for {self.intervals} "
                    "log intervals in a row",
                    rank=rank,
                    host=host,
                    step_s=step_s,
                    median_s=median,
                )
