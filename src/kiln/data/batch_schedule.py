"""The global batch size of every step: constant, or a ramp that grows it to its final size.

Large-model recipes start with a small batch (early gradients are noisy in the same direction,
so a big batch wastes samples there) and grow it in stages. Both the size of step s and the
number of sequences consumed before it are pure functions of s, so the data order, the token
count and a resume at any step need no saved state.
"""

from __future__ import annotations

import bisect
import math

from kiln.config import TrainConfig


class BatchSchedule:
    """``stages`` is a list of (global batch size, number of steps) run before ``final`` takes over."""

    def __init__(self, final: int, stages: list[tuple[int, int]] | None = None):
        stages = [(size, steps) for size, steps in stages or [] if steps > 0]
        self.final = final
        self._sizes = [size for size, _ in stages]
        # Step at which each stage ends, and the sequences consumed by then.
        self._ends, self._consumed = [], []
        step = consumed = 0
        for size, steps in stages:
            step, consumed = step + steps, consumed + size * steps
            self._ends.append(step)
            self._consumed.append(consumed)

    @classmethod
    def from_config(cls, t: TrainConfig, seq_len: int, data_ranks: int = 1) -> BatchSchedule:
        if not t.batch_ramp_start:
            return cls(t.global_batch(data_ranks))
        inc = t.batch_ramp_increment or t.batch_ramp_start
        final = t.global_batch(data_ranks)
        sizes = list(range(t.batch_ramp_start, final, inc))
        k = len(sizes)
        if t.batch_ramp_steps:
            # Stage i covers steps [i*S//k, (i+1)*S//k): equal lengths, the ramp ends at step S.
            steps = [(i + 1) * t.batch_ramp_steps // k - i * t.batch_ramp_steps // k for i in range(k)]
        else:
            # Each stage trains on an equal share of the ramp's tokens, rounded up to whole steps.
            steps = [math.ceil(t.batch_ramp_tokens / (k * size * seq_len)) for size in sizes]
        return cls(final, list(zip(sizes, steps, strict=True)))

    def resize(self, final: int) -> None:
        """Train every step at ``final`` sequences (train.global_batch_size = "auto", chosen)."""
        assert not self._ends, "a ramp's sizes are configured, not chosen"
        self.final = final

    @property
    def ramp_steps(self) -> int:
        return self._ends[-1] if self._ends else 0

    def sizes(self) -> list[int]:
        """Every global batch size the schedule uses."""
        return self._sizes + [self.final]

    def batch_size(self, step: int) -> int:
        stage = bisect.bisect_right(self._ends, step)
        return self._sizes[stage] if stage < len(self._sizes) else self.final

    def samples_before(self, step: int) -> int:
        """Sequences consumed by all steps before ``step`` (over all ranks)."""
        stage = bisect.bisect_right(self._ends, step)
        if stage == len(self._ends):
            return (self._consumed[-1] if self._consumed else 0) + (step - self.ramp_steps) * self.final
        before = self._consumed[stage - 1] if stage else 0
        start = self._ends[stage - 1] if stage else 0
        return before + (step - start) * self._sizes[stage]
