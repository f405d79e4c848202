"""The loop's instrumentation behind one context, so that the loop reads as the algorithm:
``phases.phase("data", step)`` tells the hang watchdog which phase of the step this rank is in
(named in a hang report), marks a profiler region, and times the rank's own host work for the
straggler check where the phase is such work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from kiln.distributed.watchdog import Watchdog
from kiln.observe.profiler import StepProfiler
from kiln.train.straggler import BusyClock


class Phase(NamedTuple):
    says: str  # what a hang report says the rank was doing
    region: str | None = None  # the profiler's region
    host_work: bool = False  # this rank's own work, timed on the host for the straggler check
    patient: bool = False  # long work (evaluation, a checkpoint) that keeps the watchdog's init timeout


PHASES = {
    "setup": Phase("setting up the loop (probes, run files)"),
    "data": Phase("loading the batch", "kiln/data", host_work=True),
    # The job's work on the batch before the step (GRPO's sampling): long, and of other lengths on each rank.
    "rollout": Phase("rollout (sampling and scoring the batch)", "kiln/rollout", patient=True),
    "forward_backward": Phase("forward/backward (gradient reduction)", "kiln/forward_backward"),
    "optimizer": Phase("optimizer step (gradient-norm reduction)", "kiln/optimizer"),
    "agree": Phase("step end (ranks agree to go on)"),
    "log": Phase("log point (metrics gathered, the guard's review)"),
    "evaluate": Phase("evaluation", patient=True),
    "tasks": Phase("scoring benchmark tasks (eval.tasks)", patient=True),
    "save": Phase("saving a checkpoint", patient=True),
}


class Phases:
    def __init__(self, watchdog: Watchdog, profiler: StepProfiler, clock: BusyClock):
        self.watchdog, self.profiler, self.clock = watchdog, profiler, clock

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """The block is phase ``name`` of the step after ``step`` (the steps done)."""
        p = PHASES[name]
        self.watchdog.beat(step, p.says, patient=p.patient)
        with contextlib.ExitStack() as stack:
            if p.region is not None:
                stack.enter_context(self.profiler.region(p.region))
            if p.host_work:
                stack.enter_context(self.clock.host())
            yield
