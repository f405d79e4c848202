"""checkpoint.async_save: the training thread copies the state to host memory and goes on while a
background thread writes it. What it writes must be the synchronous checkpoint exactly, a
checkpoint counts only once fully written, and a kill meanwhile leaves the previous one."""

import time

import pytest
import torch
from safetensors.torch import load_file

from kiln.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from kiln.config import DebugConfig
from kiln.train.faults import Faults

from conftest import tiny_overrides, token_sequences, train_tiny_gpt
from kilnrun import assert_equal, forked, in_process, losses, sets

ASYNC = {"checkpoint.async_save": "true"}


def test_a_background_checkpoint_is_the_synchronous_one(tmp_path):
    """Each write is slowed down, so the next steps train while it is written: what is written is
    still the state at the save, equal to what a synchronous run saves."""
    data = token_sequences(tmp_path)
    common = {"checkpoint.every": 2, "checkpoint.keep": 10}
    _, sync, _ = train_tiny_gpt(tmp_path / "sync", data, 4, 8, steps=6, **common)
    slow = {"debug.slow_save_seconds": 0.3}
    _, background, _ = train_tiny_gpt(tmp_path / "async", data, 4, 8, steps=6, **common, **ASYNC, **slow)
    saved = [list_checkpoints(t.checkpointer.dir) for t in (sync, background)]
    assert [p.name for p in saved[0]] == [p.name for p in saved[1]] == [f"step-0000000{s}" for s in (2, 4, 6)]
    for a, b in zip(*saved, strict=True):
        (weights_a, state_a), (weights_b, state_b) = (load_checkpoint(p, with_state=True) for p in (a, b))
        assert_equal(weights_a, weights_b, a.name)
        for state in (state_a, state_b):  # what differs between the runs besides the saving
            state["meter"]["interval"].pop("seconds")
            state["config"]["run"].pop("dir")
            state["config"]["checkpoint"].pop("async_save")
            state["config"].pop("debug")
        assert_equal(state_a, state_b, a.name)
    # Tied embeddings are stored once, as in the synchronous checkpoint.
    assert (saved[1][-1] / "model.safetensors").stat().st_size == (saved[0][-1] / "model.safetensors").stat().st_size


def test_one_write_in_flight_and_rotation_keeps_the_newest_complete(tmp_path):
    data = token_sequences(tmp_path)
    _, trainer, _ = train_tiny_gpt(tmp_path / "run", data, 4, 8, steps=2, **{"checkpoint.keep": 1}, **ASYNC)
    ckpt = trainer.checkpointer
    assert [p.name for p in list_checkpoints(ckpt.dir)] == ["step-00000002"]  # the end of fit waited
    ckpt.faults = Faults(DebugConfig(slow_save_seconds=0.5))
    path = ckpt.save(3)
    # save returned while step 3 is written; with keep=1 the newest complete one stays meanwhile.
    assert path.name == "step-00000003" and not path.exists() and (ckpt.dir / ".tmp-step-00000003").is_dir()
    assert [p.name for p in list_checkpoints(ckpt.dir)] == ["step-00000002"]
    ckpt.save(4)  # waits for step 3 first, which then rotates step 2 away
    assert [p.name for p in list_checkpoints(ckpt.dir)] == ["step-00000003"]
    assert ckpt.latest().name == "step-00000004"  # reading waits for the write
    assert [p.name for p in list_checkpoints(ckpt.dir)] == ["step-00000004"]


class _Unpicklable:
    def state_dict(self) -> dict:
        return {"callback": lambda: None}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_failed_background_write_raises_at_the_next_wait(tmp_path):
    data = token_sequences(tmp_path)
    _, trainer, _ = train_tiny_gpt(tmp_path / "run", data, 4, 8, steps=2, **ASYNC)
    ckpt = trainer.checkpointer
    ckpt.parts["bad"] = _Unpicklable()
    ckpt.save(3)  # the copy succeeds; writing it in the background does not
    with pytest.raises(
        CheckpointError,
        match=r"step-00000003: not written: .*pickle.*; the checkpoint before it, .*step-00000002, is intact",
    ):
        ckpt.save(4)
    assert ckpt.latest().name == "step-00000002"
    del ckpt.parts["bad"]
    ckpt.save(5)
    assert ckpt.latest().name == "step-00000005"
    assert not list(ckpt.dir.glob(".tmp-*"))  # the failed write's leftovers are gone


@pytest.mark.slow
def test_sigkill_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, corpus_dir):
    """Kill the process while step 8 is written (slowly) and training goes on past it: the newest
    complete checkpoint is step 4, and resuming from it ends bitwise where a synchronous run does."""
    common = dict(train__max_steps=12, checkpoint__every=4)
    full = tmp_path / "full"
    in_process("train", *sets(tiny_overrides(full, corpus_dir, **common)))

    killed = tmp_path / "killed"
    args = sets(tiny_overrides(killed, corpus_dir, **common, checkpoint__async_save="true"))
    proc = forked("train", *args, *sets(["debug.slow_save_seconds=2"]))
    checkpoints, in_flight, steps = killed / "checkpoints", killed / "checkpoints" / ".tmp-step-00000008", []
    deadline = time.time() + 120
    while time.time() < deadline and proc.is_alive():
        steps = list(losses(killed)) if (killed / "metrics.jsonl").exists() else []
        newest = latest_checkpoint(checkpoints)
        if newest is not None and newest.name == "step-00000004" and in_flight.is_dir() and max(steps, default=0) > 8:
            break
        time.sleep(0.02)
    proc.kill()  # SIGKILL
    proc.join()
    assert max(steps, default=0) > 8, "the run did not train on while step 8 was written"
    assert in_flight.is_dir() and latest_checkpoint(checkpoints).name == "step-00000004"

    out = in_process("train", *args).stdout
    assert "resumed from" in out and "step-00000004 at step 4" in out
    assert losses(killed) == losses(full)
    final = "checkpoints/step-00000012/model.safetensors"
    a, b = load_file(full / final), load_file(killed / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
