"""checkpoint.async_save with a sharded model on two ranks: every rank writes its shards in the
background, and only the main rank's commit, once all are written, makes the checkpoint count."""

import os
import signal
import time

import pytest
import torch

from kiln.checkpoint import latest_checkpoint

from kilnrun import losses, start
from layouts import STEPS, layout_sets, train_on, weights, workers


@pytest.mark.slow
def test_killing_every_rank_during_a_background_write_resumes_from_the_previous_checkpoint(
    tmp_path, corpus_dir, fsdp_run
):
    """SIGKILL both FSDP ranks while the step-6 checkpoint is written (its shards are on disk, the
    main rank's part is slowed down): step 3 stays the newest, and resuming from it ends bitwise
    where an uninterrupted synchronous run does."""
    ref = fsdp_run  # the same run, synchronous

    run_dir = tmp_path / "killed"
    sets = layout_sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp", checkpoint__async_save="true")
    launcher = start("launch", "--nproc-per-node", "2", "--", "train", *sets, "--set", "debug.slow_save_seconds=2")
    checkpoints, in_flight = run_dir / "checkpoints", run_dir / "checkpoints" / f".tmp-step-{STEPS:08d}"
    deadline = time.time() + 180
    while time.time() < deadline and launcher.poll() is None:
        newest = latest_checkpoint(checkpoints)
        if newest is not None and newest.name == "step-00000003" and list(in_flight.glob("state/*.distcp")):
            break
        time.sleep(0.02)
    ranks = workers(launcher.pid)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    launcher.wait(timeout=120)
    assert len(ranks) == 2 and launcher.returncode != 0, "the run ended before its ranks could be killed"
    assert in_flight.is_dir() and latest_checkpoint(checkpoints).name == "step-00000003"

    out = train_on(2, sets).stdout
    assert "resumed from" in out and "at step 3" in out
    assert losses(run_dir) == losses(ref)
    for (name, a), b in zip(weights(run_dir).items(), weights(ref).values(), strict=True):
        assert torch.equal(a, b), name
