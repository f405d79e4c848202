"""The processes that prepare data together: one alone, or every rank of a launched job.

Data preparation splits its work over the ranks (each reads, hashes and tokenizes its share of
the files) and only needs the few things ``Team`` names from the group, so this layer does not
import the distributed one; ``kiln.distributed.World`` is a Team.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")


class Team(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def each(self, work: Callable[[], T], what: str) -> list[T]:
        """Every rank runs its own ``work()`` (which must not itself talk to the other ranks); the
        results of all ranks, in rank order, once all are done. However long one takes, no rank
        waits on a collective long enough to time out; if any rank's work fails, every rank
        raises."""
        ...

    def share(self, value: T, src: int) -> T:
        """Rank ``src``'s ``value`` (anything picklable), on every rank."""
        ...


class Alone:
    """A team of one process."""

    rank, size = 0, 1

    def each(self, work: Callable[[], T], what: str) -> list[T]:
        return [work()]

    def share(self, value: T, src: int) -> T:
        return value


ALONE = Alone()


def share_of(weights: Sequence[int], size: int, rank: int) -> range:
    """The contiguous run of items (files, by their sizes ``weights``) that ``rank`` of ``size``
    takes: each rank's run starts at the first item whose start lies at or after its equal share
    of the total, so the runs are in order, cover every item once and are about equal in weight
    (one item is never split: a single huge file goes to one rank)."""
    total = sum(weights)
    starts, at = [], 0
    for w in weights:
        starts.append(at)
        at += w

    def first(r: int) -> int:
        if r >= size:
            return len(weights)
        bound = total * r / size
        return next((i for i, s in enumerate(starts) if s >= bound), len(weights))

    return range(first(rank), first(rank + 1))
