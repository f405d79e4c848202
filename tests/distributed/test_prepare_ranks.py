"""Ranks waiting for rank 0 to prepare the data: however long it takes, no collective times out."""

from __future__ import annotations

import pytest

from kilnrun import launch, losses, sets
from layouts import layout_sets, train_on

pytestmark = pytest.mark.dist


@pytest.mark.slow
def test_a_preparation_longer_than_the_collective_timeout_does_not_time_out(tmp_path, corpus_dir):
    """With parallel.init_timeout=1s the process group gives up on a collective after about 16 s;
    rank 0 prepares for 20 s more than it needs, while rank 1 meets it every 2 s."""
    run_dir = tmp_path / "run"
    sets = layout_sets(
        run_dir, corpus_dir, micro=2, train__max_steps=2, parallel__init_timeout="1s", debug__slow_prepare_seconds=20
    )
    proc = train_on(2, sets)
    assert sorted(losses(run_dir)) == [1, 2], proc.stderr[-2000:]


def test_kiln_launch_prepare_prepares_once(tmp_path, corpus_dir):
    cache = tmp_path / "cache"
    proc = launch(2, "prepare", *sets([f"data.source={corpus_dir}", "data.vocab_size=300", f"data.cache_dir={cache}"]))
    assert proc.stdout.count("kiln: tokenized") == 1
    assert len(list((cache / "prepared").iterdir())) == 1
