"""How long a run is: ``train.max_steps``, or with ``"auto"`` as many steps as fit
``train.time_budget``.

The plan is measured, not guessed: at the start of a fresh run the loop times one checkpoint,
a few real training steps (after a warm-up, which takes the compile, the allocator's first
growth and the caches) and one evaluation, then puts the run back exactly as it was. The number of steps
is then the most whose training, evaluations and checkpoints, the final ones included, end
inside the budget. It is part of the run's state: a resumed run keeps the steps it planned, so
its learning-rate schedule is the one it started with.

Step times drift over a run (on a shared or throttled machine by a tenth or more), so the process
that planned corrects the plan with the pace it actually kept, halfway and again halfway through
the rest (CORRECTIONS times): where the schedule's
rate up to then does not depend on the number of steps (constant, or warmup-stable-decay before
its decay, which the correction never moves behind the current step), the corrected run trains
exactly as a run given the corrected steps as a number.
"""

from __future__ import annotations

import dataclasses
import math

from kiln.config import Config, parse_duration

# Steps whose time is not counted, at least (see TimePlan.warmup_seconds): the first runs
# compile, the first few grow the allocator.
WARMUP_STEPS = 2
# The plan aims this far inside the budget, for the jitter of step times; a run that turns out
# slower than measured may go this far past it to end its schedule, and is stopped there.
MARGIN = 0.04
OVERRUN = 0.05
# Corrections of the plan with the pace kept (see above): at 1/2 and 3/4 of the run.
CORRECTIONS = 2


@dataclasses.dataclass
class Costs:
    """Seconds, measured in the probe: one training step, one evaluation, one checkpoint, and
    the data loader's start before the first batch."""

    step_s: float
    eval_s: float
    save_s: float
    start_s: float


class TimePlan:
    def __init__(self, cfg: Config):
        t = cfg.train
        self.auto = t.max_steps == "auto"
        self.max_steps: int | None = None if self.auto else t.max_steps
        self.costs: Costs | None = None
        self.budget_s = parse_duration(t.time_budget) if t.time_budget else math.inf
        self.eval_every, self.save_every = cfg.eval.every, cfg.checkpoint.every
        self.schedule, self.decay_fraction = t.schedule, t.decay_fraction
        self.correct_at: int | None = None  # the step of the next correction (set by fix)
        self.corrections_left = 0

    @property
    def needs_probe(self) -> bool:
        return self.max_steps is None

    @property
    def stop_s(self) -> float:
        """When the loop stops whatever the plan: the budget, a little later for a planned run."""
        return self.budget_s * (1 + OVERRUN) if self.auto else self.budget_s

    def probe_seconds(self) -> float:
        """How long to time training steps for: long enough to average out their jitter, a
        small share of the budget."""
        return min(30.0, max(2.0, 0.03 * self.budget_s))

    def warmup_seconds(self) -> float:
        """How long to run steps before timing them: the first few of a process are slower
        (allocator growth, kernel and thread-pool caches), for longer than a step or two."""
        return 0.25 * self.probe_seconds()

    def state_dict(self) -> dict:
        return {"max_steps": self.max_steps, "costs": dataclasses.asdict(self.costs) if self.costs else None}

    def load_state_dict(self, state: dict) -> None:
        if self.auto and state.get("max_steps") is not None:
            self.max_steps = state["max_steps"]
            self.costs = Costs(**state["costs"]) if state.get("costs") else None

    def cost_s(self, steps: int, costs: Costs) -> float:
        """Seconds that ``steps`` steps take from the first: training, every evaluation and
        checkpoint (periodic and final) and the data loader's start."""
        evals = math.ceil(steps / self.eval_every) if self.eval_every else 1
        saves = math.ceil(steps / self.save_every) if self.save_every else 1
        return costs.start_s + steps * costs.step_s + evals * costs.eval_s + saves * costs.save_s

    def fix(self, costs: Costs, elapsed_s: float) -> int:
        """Fix max_steps from the probe's ``costs`` with ``elapsed_s`` of the budget spent: the
        most steps whose cost ends inside it (at least one)."""
        low = self._most_steps(self.budget_s * (1 - MARGIN) - elapsed_s, costs, least=1)
        self.max_steps, self.costs = low, costs
        if self.schedule in ("constant", "wsd") and low >= 8:
            self.correct_at, self.corrections_left = low // 2, CORRECTIONS
        return low

    def correct(self, step: int, step_s: float, elapsed_s: float) -> int:
        """The steps that fill the budget at the pace kept so far (``step_s`` a step), ``step``
        steps and ``elapsed_s`` seconds into the run; never so few that a decay would have had
        to start before ``step``."""
        costs = dataclasses.replace(self.costs, step_s=step_s)
        seconds = self.budget_s * (1 - MARGIN) - elapsed_s + self.cost_s(step, costs)
        steps = self._most_steps(seconds, costs, least=step + 1)
        if self.schedule == "wsd":
            while steps - max(1, round(self.decay_fraction * steps)) < step:
                steps += 1
        self.corrections_left -= 1
        later = step + (steps - step) // 2
        self.max_steps, self.correct_at = steps, later if self.corrections_left and later > step else None
        return steps

    def _most_steps(self, seconds: float, costs: Costs, least: int) -> int:
        """The most steps whose cost from the first fits in ``seconds`` (at least ``least``)."""
        low, high = least, least
        while self.cost_s(high, costs) <= seconds:
            low, high = high, high * 2
        while high - low > 1:  # cost_s(low) fits (or low is least), cost_s(high) does not
            mid = (low + high) // 2
            low, high = (mid, high) if self.cost_s(mid, costs) <= seconds else (low, mid)
        return low

    def describe(self) -> str:
        c = self.costs
        return (
            f"planned {self.max_steps} steps to fill the time budget: a step takes {c.step_s:.3g}s, "
            f"an evaluation {c.eval_s:.3g}s, a checkpoint {c.save_s:.3g}s (measured at the start)"
        )
