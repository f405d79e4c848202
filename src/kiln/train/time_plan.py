"""How long a run is: ``train.max_steps``, or with ``"auto"`` as many steps as fit
``train.time_budget``.

The plan is measured, not guessed: at the start of a fresh run the loop times one checkpoint,
a few real training steps (after a warm-up, which takes the compile, the allocator's first
growth and the caches) and one evaluation, then puts the run back exactly as it was. The number of steps
is then the most whose training, evaluations and checkpoints, the final ones included, end
inside the budget. It is part of the run's state: a resumed run keeps the steps it planned, so
its learning-rate schedule is the one it started with (a plan that was still the probe's first
estimate, below, is made again by the resumed process, from its step, for its own budget).

Where the schedule's rate up to a step does not depend on the number of steps (constant, or
warmup-stable-decay before its decay), the process that planned corrects the plan with the pace
its own steps keep, and the corrected run trains exactly as a run given the corrected steps as a
number. That lets the probe be short: it only gauges the pace (and chooses the batch), the run
starts at once, and its first steps after their warm-up time the pace that fixes the plan (the
probe's steps are put back, the run's are not wasted). Step times also drift over a run (on a
shared or throttled machine by a tenth or more), so the plan is corrected again halfway and
halfway through the rest (CORRECTIONS times), never moving a decay's start behind the current step.
Other schedules (cosine, linear) are timed in full before the run and not corrected.

A planned run also ends once it has read its training data ``data.max_epochs`` times, however much
budget is left: on a small corpus more passes fit the training text ever closer and the held-out
text worse (five minutes on 1.1 MB of Shakespeare read it some 15 times and ended worse than 45
seconds did, BENCHMARKS.md). The batch is then chosen for the tokens those passes hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from kiln.config import Config, parse_duration
from kiln.data.batch_schedule import BatchSchedule
from kiln.distributed.world import World

# Steps whose time is not counted, at least (see TimePlan.warmup_seconds): the first runs
# compile, the first few grow the allocator.
WARMUP_STEPS = 2
# The plan aims this far inside the budget, for the jitter of step times; a run that turns out
# slower than measured may go this far past it to end its schedule, and is stopped there.
MARGIN = 0.04
OVERRUN = 0.05
# Corrections of the plan with the pace kept (see above): at 1/2 and 3/4 of the run.
CORRECTIONS = 2
# global_batch_size = "auto" (see choose_batch): the batch, in tokens, grows as the square root of
# the tokens the budget buys, through this point: five-minute runs of the default model on a
# 2-core CPU, which trained on about 2.1M tokens, ended lower at 16 x 128 tokens a step than at
# 32 x 128 (BENCHMARKS.md, "Small text, short budget", which also has the 45-second runs).
REFERENCE_BATCH_TOKENS = 2048
REFERENCE_RUN_TOKENS = 2.1e6


@dataclasses.dataclass
class Costs:
    """Seconds, measured in the probe: one training step, one evaluation, one checkpoint, and
    the data loader's start before the first batch."""

    step_s: float
    eval_s: float
    save_s: float
    start_s: float


def choose_batch(run_tokens: float, tokens_per_sample: int, micro: int, data_ranks: int) -> int:
    """The global batch (sequences) for a run that can train on about ``run_tokens`` tokens.

    Below the critical batch size a step's worth grows with its batch, above it barely, and that
    size grows as training goes on (the gradient's noise scale rises as the loss falls): a short
    run is best spent on many small steps, a long one on larger ones. kiln's rule: the batch in
    tokens is REFERENCE_BATCH_TOKENS x sqrt(run_tokens / REFERENCE_RUN_TOKENS); per rank, rounded
    down to a power of two up to the micro-batch (a smaller micro-batch), and beyond it down to a
    whole number of micro-batches (accumulation). Down, because a batch above the critical size
    wastes tokens, while one below it only runs a little slower."""
    target = REFERENCE_BATCH_TOKENS * math.sqrt(max(run_tokens, 1.0) / REFERENCE_RUN_TOKENS)
    per_rank = target / (tokens_per_sample * data_ranks)
    if per_rank < micro:
        return 2 ** int(math.log2(max(per_rank, 1.0))) * data_ranks
    return micro * int(per_rank // micro) * data_ranks


def _most(holds: Callable[[int], bool], least: int) -> int:
    """The largest n >= ``least`` for which ``holds(n)``, a test that holds up to some n and not
    beyond (``least`` where it holds for none): doubling, then bisection."""
    low, high = least, max(least, 1)
    while holds(high):
        low, high = high, high * 2
    while high - low > 1:  # holds(low), or low is least; not holds(high)
        mid = (low + high) // 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low


class TimePlan:
    def __init__(
        self,
        cfg: Config,
        schedule: BatchSchedule,
        tokens_per_sample: int,
        data: Dataset | None = None,
        repeat: int = 1,
    ):
        t = cfg.train
        self.auto = t.max_steps == "auto"
        self.max_steps: int | None = None if t.max_steps == "auto" else t.max_steps
        # global_batch_size = "auto": the schedule's batch is chosen in the probe (None: not yet).
        self.auto_batch = t.chooses_batch
        self.batch: int | None = None
        # The run's schedule, which a chosen batch resizes: the loader and the memory ladder read it.
        self.batch_schedule, self.tokens_per_sample = schedule, tokens_per_sample
        self.micro = t.nominal_micro_batch  # the probe's micro-batch, which the batch is chosen with
        self.costs: Costs | None = None
        self.budget_s = parse_duration(t.budget) if t.budget else math.inf
        self.budget = t.budget
        self.eval_every, self.save_every = cfg.eval.every, cfg.checkpoint.every
        self.schedule, self.decay_fraction = t.schedule, t.decay_fraction
        # Corrections (see the module's doc), set up by fix, loop_starts and due.
        self.correctable = t.schedule in ("constant", "wsd")
        self.first_estimate = False  # fixed from the probe's rough pace, to be corrected early
        self.loop_start: tuple[int, float] | None = None  # the loop's first step and clock
        self.timed: tuple[int, float] | None = None  # where the pace's timing started
        self.correct_at: int | None = None  # a correction after this step at the latest
        self.start_step = 0  # where the process that planned started
        self.corrections_left = 0
        # The step that compiles, after train.compile_after eager ones: the pace is timed after it.
        self.compile_step = t.compile_after + 1 if t.compile is True and t.compile_after else None
        # The sequences data.max_epochs passes over the training data hold (unknown: no end),
        # each batch of them trained on for ``repeat`` steps (the loader's).
        self.max_epochs = cfg.data.max_epochs
        self.pass_sequences = len(data) if isinstance(data, Sized) else None
        self.repeat = repeat
        self.data_bound = False  # the plan ends where the passes do, before the budget

    @property
    def needs_probe(self) -> bool:
        return self.max_steps is None

    @property
    def steps(self) -> int:
        """``max_steps``, known once the loop is set up (configured, resumed or planned)."""
        assert self.max_steps is not None
        return self.max_steps

    @property
    def stop_s(self) -> float:
        """When the loop stops whatever the plan: the budget, a little later for a planned run."""
        return self.budget_s * (1 + OVERRUN) if self.auto else self.budget_s

    def probe_seconds(self) -> float:
        """How long to time training steps for: long enough to average out their jitter, a
        small share of the budget."""
        return min(30.0, max(2.0, 0.02 * self.budget_s))

    def warmup_seconds(self) -> float:
        """How long to run steps before timing them: the first few of a process are slower
        (allocator growth, kernel and thread-pool caches), for longer than a step or two."""
        return 0.25 * self.probe_seconds()

    def state_dict(self) -> dict:
        costs = dataclasses.asdict(self.costs) if self.costs else None
        plan = {"max_steps": self.max_steps, "costs": costs, "first_estimate": self.first_estimate}
        return {**plan, "global_batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        # A first estimate is not kept: the resumed process plans its own budget from where it is
        # (its rate so far did not depend on the steps), with the batch already chosen.
        if self.auto and state.get("max_steps") is not None and not state.get("first_estimate"):
            self.max_steps = state["max_steps"]
            self.costs = Costs(**state["costs"]) if state.get("costs") else None
        if self.auto_batch and state.get("global_batch"):
            self._resize(state["global_batch"])

    def _resize(self, batch: int) -> None:
        self.batch = batch
        self.batch_schedule.resize(batch)

    def resolved(self, cfg: Config, micro_batch_size: int) -> Config:
        """``cfg`` with what this plan decided in place of "auto": the steps, the global batch
        and with it the ``micro_batch_size`` in use (smaller where a rank's share of the batch is)."""
        t = cfg.train
        if self.auto_batch and self.batch:
            t = dataclasses.replace(t, global_batch_size=self.batch, micro_batch_size=micro_batch_size)
        return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=self.steps))

    def cost_s(self, steps: int, costs: Costs, final: bool = True) -> float:
        """Seconds that ``steps`` steps take from the first: training, every evaluation and
        checkpoint (periodic and, unless not ``final``, the last step's) and the data loader's start."""
        ends = math.ceil if final else math.floor
        evals = ends(steps / self.eval_every) if self.eval_every else int(final)
        saves = ends(steps / self.save_every) if self.save_every else int(final)
        return costs.start_s + steps * costs.step_s + evals * costs.eval_s + saves * costs.save_s

    def fix(self, costs: Costs, elapsed_s: float, first_estimate: bool = False, start: int = 0) -> int:
        """Fix max_steps from the probe's ``costs`` with ``elapsed_s`` of the budget spent, for a
        run at step ``start``: the most steps whose cost ends inside it (at least one more), no
        more than its data's passes allow. A ``first_estimate`` (a rough pace) is corrected once
        the run's own steps have been timed (see due)."""
        low = self._within_passes(
            start + self._most_steps(self.budget_s * (1 - MARGIN) - elapsed_s, costs, least=1), start
        )
        self.max_steps, self.costs, self.start_step = low, costs, start
        if self.correctable and low >= 8:
            self.corrections_left = CORRECTIONS + first_estimate
            self.first_estimate = first_estimate
            self.correct_at = None if first_estimate else min((start + low) // 2, self._decay_start(low))
        return low

    def loop_starts(self, step: int, elapsed_s: float) -> None:
        """The loop's first step is ``step``, ``elapsed_s`` into the budget."""
        self.loop_start = self.timed = (step, elapsed_s)
        if self.first_estimate:  # corrected by time (see due), or before its decay at the latest
            self.timed = None
            self.correct_at = min(step + (self.steps - step) // 2, self._decay_start(self.steps))

    def due(self, step: int, elapsed_s: float) -> bool:
        """Is the plan to be corrected after ``step``, ``elapsed_s`` into the budget? A first
        estimate is, once the run's own steps have been timed as long as the probe would have
        timed them, after their warm-up (the loader's start, the first allocations); it starts
        that timing itself. The step that compiles (train.compile_after) starts the timing
        again, warm-up and all: the plan is for the compiled steps, and the compile's seconds
        count as spent. The ranks agree on the answer (the loop's ``World.agree``)."""
        if step == self.compile_step:
            self.loop_start, self.timed = (step, elapsed_s), None
        if self.first_estimate:
            assert self.loop_start is not None  # set before the loop's first step
            first_step, first_s = self.loop_start
            warm = step - first_step >= WARMUP_STEPS and elapsed_s - first_s >= self.warmup_seconds()
            if self.timed is None and warm:
                self.timed = (step, elapsed_s)
            if self.timed and step - self.timed[0] >= 3 and elapsed_s - self.timed[1] >= self.probe_seconds():
                return True
        return step == self.correct_at

    def _decay_start(self, steps: int) -> int:
        """The first step whose rate depends on the number of steps (a correctable schedule's)."""
        return steps - max(1, round(self.decay_fraction * steps)) if self.schedule == "wsd" else steps

    def correct(self, step: int, step_s: float, elapsed_s: float) -> int:
        """The steps that fill the budget at the pace kept so far (``step_s`` a step), ``step``
        steps and ``elapsed_s`` seconds into the run; never so few that a decay would have had
        to start before ``step``."""
        assert self.costs is not None  # correct_at, which calls for a correction, is set with them (fix)
        costs = dataclasses.replace(self.costs, step_s=step_s)
        done = step - self.start_step  # by this process, in ``elapsed_s``
        seconds = self.budget_s * (1 - MARGIN) - elapsed_s + self.cost_s(done, costs, final=False)
        steps = self._within_passes(self.start_step + self._most_steps(seconds, costs, least=done + 1), step)
        while self._decay_start(steps) < step:
            steps += 1
        self.corrections_left -= 1
        self.first_estimate = False
        # The next correction comes no later than the decay's start, so that every step before it
        # trained at the rate of a run given the final steps as a number.
        later = min(step + (steps - step) // 2, self._decay_start(steps))
        self.max_steps, self.correct_at = steps, later if self.corrections_left and later > step else None
        return steps

    def passes_steps(self) -> int | None:
        """The steps whose batches hold data.max_epochs passes over the training data (None:
        its size is not known)."""
        if self.pass_sequences is None:
            return None
        sequences = self.max_epochs * self.pass_sequences
        batches = _most(lambda steps: self.batch_schedule.samples_before(steps) < sequences, least=0) + 1
        return batches * self.repeat

    def _within_passes(self, steps: int, step: int) -> int:
        """``steps``, or fewer where the data's passes end first (never before ``step`` + 1)."""
        passes = self.passes_steps()
        self.data_bound = passes is not None and passes < steps
        return max(step + 1, passes) if passes is not None and self.data_bound else steps

    def _most_steps(self, seconds: float, costs: Costs, least: int) -> int:
        """The most steps whose cost from the first fits in ``seconds`` (at least ``least``)."""
        return _most(lambda steps: self.cost_s(steps, costs) <= seconds, least)

    # -- measuring and correcting, on the run itself ------------------------------------------------

    def measure(
        self,
        world: World,
        checkpointer: Any,
        *,
        batches: Callable[[], Iterator[Any]],
        train: Callable[[Any, int], None],
        evaluate: Callable[[], Any],
        save: Callable[[], Path],
        device: torch.device,
        elapsed: Callable[[], float],
        logger: Any,
        step: int,
    ) -> None:
        """Plan ``max_steps`` for "auto": time a checkpoint (``save``), training steps (``train(batch,
        i)``, the i-th probe step, on the loader's batches) and an evaluation of this very run, put
        the run back exactly as it was (``checkpointer.hold`` and ``put_back``), and fix the steps
        that fill the budget, ``elapsed()`` of it spent; the plan is logged at ``step``. Every rank
        plans with the slowest rank's costs and clock, so that all agree on the steps."""
        held = checkpointer.hold()
        resumed_at = checkpointer.latest()
        save_s = self._warm_seconds(world, save)
        path = checkpointer.latest()
        # Where the run's own steps will correct the plan, or the batch is still to choose, this
        # timing only gauges the pace (a quarter as long).
        rough = self.correctable or self.auto_batch
        step_s, start_s = self._step_seconds(world, batches, train, device, rough=rough)
        eval_s = self._warm_seconds(world, evaluate)
        if self.auto_batch and self.batch is None:  # (a resumed run has its batch)
            # The tokens the budget buys at the probe's batch (one micro-batch a rank) choose the
            # batch. Its steps are timed by the run itself where they can be (taken to keep the
            # probe's tokens a second until then), or else timed again here.
            probe = Costs(*world.largest(step_s, eval_s, save_s, start_s))
            probe_batch = self.batch_schedule.final
            sequences = self._most_steps(self.budget_s - elapsed(), probe, least=1) * probe_batch
            if self.pass_sequences is not None:  # no more tokens than the passes hold
                sequences = min(sequences, self.max_epochs * self.pass_sequences * self.repeat)
            tokens = sequences * self.tokens_per_sample
            batch = choose_batch(tokens, self.tokens_per_sample, self.micro, world.data_ranks)
            self._resize(batch)
            if self.correctable:
                step_s *= batch / probe_batch
            else:  # warm already: a few steps settle the new shapes
                step_s, start_s = self._step_seconds(world, batches, train, device, warm=True)
        checkpointer.put_back(held)
        if path != resumed_at:
            checkpointer.discard(path)
        *costs, elapsed_s = world.largest(step_s, eval_s, save_s, start_s, elapsed())
        self.fix(Costs(*costs), elapsed_s, first_estimate=self.correctable, start=step)
        logger.event(
            step,
            "time_plan",
            self.describe(),
            max_steps=self.max_steps,
            global_batch=self.batch_schedule.final,
            **vars(self.costs),
        )

    def _step_seconds(
        self,
        world: World,
        batches: Callable[[], Iterator[Any]],
        train: Callable[[Any, int], None],
        device: torch.device,
        warm: bool = False,
        rough: bool = False,
    ) -> tuple[float, float]:
        """Seconds a training step takes once warm, and the loader's start before its first batch."""
        share = 0.25 if rough else 1.0
        probe_s = self.probe_seconds() * share
        warmup_s = 0.0 if warm else self.warmup_seconds() * share
        started = time.perf_counter()
        loader = batches()
        start_s, timed_from, steps = 0.0, None, 0
        for i in itertools.count():
            batch = next(loader)
            start_s = start_s or time.perf_counter() - started
            train(batch, i)  # whatever it changes is put back below
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            if timed_from is not None:
                steps += 1
            elif i + 1 >= WARMUP_STEPS and now - started >= warmup_s:
                timed_from = now  # warm: the compile, the allocator's growth and the caches are behind
            # Every rank runs the same number of probe steps, or one would wait in a collective.
            # Steps are counted once timed_from is set.
            (done,) = world.agree(timed_from is not None and steps >= 3 and now - timed_from >= probe_s)
            if done:
                break
        del loader  # its workers stop
        assert timed_from is not None  # the loop ends only after timed steps
        return (now - timed_from) / steps, start_s

    def correct_pace(self, world: World, step: int, elapsed_s: float, logger: Any) -> None:
        """Plan again with the pace this run has kept since its timing started (see
        loop_starts), ``step`` steps and ``elapsed_s`` seconds in: the slowest rank's pace and
        clock, so that every rank plans the same steps."""
        assert self.costs is not None  # correct_at and due, which call for a correction, are set with them (fix)
        timing = self.timed or self.loop_start
        assert timing is not None  # set before the loop's first step (loop_starts)
        first_step, first_s = timing
        done = step - first_step
        evals = step // self.eval_every - first_step // self.eval_every if self.eval_every else 0
        saves = step // self.save_every - first_step // self.save_every if self.save_every else 0
        spent = elapsed_s - first_s - evals * self.costs.eval_s - saves * self.costs.save_s
        step_s, elapsed = world.largest(max(spent, 0.0) / done, elapsed_s)
        before = self.max_steps
        steps = self.correct(step, step_s, elapsed)
        logger.total_steps = steps
        logger.event(
            step,
            "time_replan",
            f"corrected the plan at step {step}: {before} -> {steps} steps "
            f"(a step took {step_s:.3g}s, {self.costs.step_s:.3g}s in the probe)",
            max_steps=steps,
            step_s=step_s,
        )

    def _warm_seconds(self, world: World, work: Callable[[], Any]) -> float:
        """How long ``work`` takes once warm: the first call also pays for imports and first
        allocations, so one that is very cheap next to the budget is timed a second time (not an
        evaluation of the default run, 0.5-0.7 s of a five-minute budget: every second here delays
        the first step). The slowest rank's time decides, so that every rank runs ``work`` (and
        its collectives) as often."""
        started = time.perf_counter()
        work()
        (seconds,) = world.largest(time.perf_counter() - started)
        if seconds > 0.001 * self.budget_s:
            return seconds
        started = time.perf_counter()
        work()
        return time.perf_counter() - started

    def describe(self) -> str:
        c = self.costs
        assert c is not None  # described once planned (fix)
        batch = f" of {self.batch} sequences (global_batch_size=auto)" if self.auto_batch else ""
        estimate = "; a first estimate, which the run's first steps correct" if self.first_estimate else ""
        end = (
            f"to read its {self.pass_sequences:,} training sequences {self.max_epochs:g} times (data.max_epochs), "
            f"inside the {self.budget} time budget"
            if self.data_bound
            else f"to fill the {self.budget} time budget"
        )
        return (
            f"planned {self.max_steps} steps{batch} {end}: a step takes {c.step_s:.3g}s, "
            f"an evaluation {c.eval_s:.3g}s, a checkpoint {c.save_s:.3g}s (measured at the start{estimate})"
        )
