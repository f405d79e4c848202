"""The data order of a weighted mixture: each source's share, exact over every block and close
at any step; a pure function of the seed and the position; each source's sequences once per epoch."""

import numpy as np
import pytest

from kiln.data.loader import StepSampler, TokenSequences
from kiln.data.mixture import BLOCK, Mixture, quotas


def mixture(sizes=(50, 20), weights=(0.8, 0.2), seed=0) -> Mixture:
    sources = [TokenSequences(np.arange(n * 4 + 1, dtype=np.uint16), 4) for n in sizes]
    return Mixture([f"s{i}" for i in range(len(sizes))], sources, list(weights), seed)


def test_quotas_fill_the_block_as_close_to_the_weights_as_whole_positions_allow():
    assert quotas([0.8, 0.2]) == [800, 200]
    assert quotas([1, 1, 1]) == [334, 333, 333]
    assert sum(quotas([0.7, 0.2, 0.1, 0.0004 + 0.3])) == BLOCK


def test_each_source_gives_its_share_and_the_count_matches_the_items_drawn():
    m = mixture()
    items = [m.item(g) for g in range(1600)]
    origin = [int(i >= m.offsets[1]) for i in items]  # source 1's items follow source 0's
    for n in (400, 1000, 1600):
        share = origin[:n].count(0) / n
        assert share == pytest.approx(0.8, abs=0.01), n
        assert m.drawn(n) == [origin[:n].count(0), origin[:n].count(1)]
    assert m.drawn(1000) == [800, 200]


def test_the_order_is_a_pure_function_of_seed_and_position_and_each_epoch_holds_every_sequence():
    a, b = mixture(seed=3), mixture(seed=3)
    ga = [a.item(g) for g in range(3000)]
    assert ga == [b.item(g) for g in reversed(range(3000))][::-1]  # in any order of asking
    assert ga != [mixture(seed=4).item(g) for g in range(3000)]
    small = [i - a.offsets[1] for i in ga if i >= a.offsets[1]]
    for epoch in range(len(small) // 20):
        assert sorted(small[epoch * 20 : (epoch + 1) * 20]) == list(range(20))


def test_ranks_share_each_step_of_the_same_order():
    m = mixture()
    whole = [i for batch in zip(range(10), StepSampler(m, 8, seed=0), strict=False) for i in batch[1]]
    ranks = [StepSampler(m, 8, seed=0, rank=r, world_size=2) for r in range(2)]
    split = [i for _, *parts in zip(range(10), *ranks, strict=False) for part in parts for i in part]
    assert split == whole == [m.item(g) for g in range(80)]
