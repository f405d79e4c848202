"""How much of each source of a data mixture a run has read, for its metrics."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from kiln.data.batch_schedule import BatchSchedule
from kiln.data.mixture import Mixture


class SourceUse:
    """Tokens and epochs drawn from each source of a ``Mixture`` by the steps done, as metrics
    (``data/tokens/<name>``, ``data/epochs/<name>``); an event the first time a source has been
    read more than ``max_epochs`` times over. Nothing for a single corpus. Computed from the data
    order (a pure function of the step), so it costs no communication and survives a resume."""

    def __init__(self, data: Dataset, schedule: BatchSchedule, max_epochs: float):
        self.mixture = data if isinstance(data, Mixture) else None
        self.schedule, self.max_epochs = schedule, max_epochs
        self.warned: set[str] = set()

    def metrics(self, step: int, logger: Any) -> dict[str, float]:
        if self.mixture is None:
            return {}
        m, out = self.mixture, {}
        for name, drawn, size in zip(m.names, m.drawn(self.schedule.samples_before(step)), m.sizes, strict=True):
            epochs = drawn / size
            out[f"data/tokens/{name}"] = float(drawn * m.seq_len)
            out[f"data/epochs/{name}"] = epochs
            if epochs > self.max_epochs and name not in self.warned:
                self.warned.add(name)
                logger.event(
                    step,
                    "data_repeated",
                    f"data.mix source {name!r} has been read {epochs:.1f} times over (data.max_epochs = "
                    f"{self.max_epochs:g}): its {size:,} sequences repeat; give it less weight or more data",
                    source=name,
                    epochs=epochs,
                )
        return out
