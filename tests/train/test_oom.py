"""The out-of-memory ladder and the micro-batch probe, driven by an injected out-of-memory error
(the exception type the CUDA allocator raises) above a micro-batch size."""

import json

import pytest
import torch

from kiln.checkpoint import latest_checkpoint, load_checkpoint
from kiln.train.memory_ladder import OutOfMemoryExhausted, Rung, largest_fitting, micro_batch_options, next_rung

from conftest import tiny_overrides, token_sequences, train_tiny_gpt
from kilnrun import in_process, sets


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _oom_above(above, from_step=0, **extra):
    """The [debug] settings of a device that runs out of memory above ``above`` sequences."""
    return {"debug.oom_above": above, "debug.oom_from_step": from_step, **extra}


def test_ladder_rungs_in_order():
    options = micro_batch_options([24, 12])  # a ramp from 12 to 24 sequences per rank
    assert options == [12, 6, 4, 3, 2, 1]
    rung, seen = Rung(12), []
    while rung is not None:
        seen.append(rung)
        rung = next_rung(rung, options, can_offload=True)
    assert [r.describe() for r in seen] == [
        "micro-batch 12",
        "micro-batch 6",
        "micro-batch 3",
        "micro-batch 1",
        "micro-batch 1 + activation checkpointing",
        "micro-batch 1 + activation checkpointing + CPU offload",
    ]
    assert next_rung(Rung(1, True), options, can_offload=False) is None
    assert largest_fitting(options, lambda m: m <= 5) == 4
    assert largest_fitting(options, lambda m: False) is None


def test_the_ladder_follows_a_batch_the_time_plan_chooses(tmp_path):
    """The time plan changes the run through its BatchSchedule alone (global_batch_size = "auto"):
    the ladder's micro-batches then split each rank's share of the chosen batch, none larger."""
    from kiln.config import load_config
    from kiln.data.batch_schedule import BatchSchedule
    from kiln.distributed.world import World
    from kiln.train.memory_ladder import MemoryLadder, starting_rung

    schedule = BatchSchedule(64)
    cfg = load_config(None, [f"run.dir={tmp_path}", "train.micro_batch_size=16", "train.global_batch_size=64"])
    start = starting_rung(cfg, World(), schedule, tmp_path, print)
    assert start == (Rung(16), False)
    ladder = MemoryLadder(cfg, World(), schedule, tmp_path, None, start)  # no step needed without recomputation
    assert ladder.micro_batch_size == 16 and ladder.options[0] == 64
    schedule.resize(12)  # what TimePlan does when it chooses the batch
    assert ladder.micro_batch_size == 12 and ladder.options == [12, 6, 4, 3, 2, 1]
    schedule.resize(24)
    assert ladder.micro_batch_size == 12  # a rung is never raised


def test_oom_mid_run_retries_the_same_step_at_smaller_micro_batches(tmp_path):
    data = token_sequences(tmp_path)
    ref, _, _ = train_tiny_gpt(tmp_path / "ref", data, micro=2, global_=16, steps=6)
    # From step 3 (0-based) on, any micro-batch above 2 sequences "runs out of memory": the step
    # fails at 8, then at 4, and succeeds at 2, all from the same data.
    model, trainer, result = train_tiny_gpt(tmp_path / "oom", data, micro=8, global_=16, steps=6, **_oom_above(2, 3))
    assert result.step == 6 and trainer.micro_batch_size == 2
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    records = _records(tmp_path / "oom")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # no step lost or repeated
    assert {r["global_batch"] for r in steps} == {16}
    assert [r["micro_batch_size"] for r in steps] == [8, 8, 8, 2, 2, 2]
    events = [r for r in records if r.get("event") == "out_of_memory"]
    assert [(e["step"], e["micro_batch_size"]) for e in events] == [(4, 4), (4, 2)]
    assert "injected" in events[0]["error"] and "global batch is unchanged" in events[0]["message"]
    # The rung is saved with the run: in the checkpoint and in memory.json.
    _, state = load_checkpoint(latest_checkpoint(tmp_path / "oom" / "checkpoints"), with_state=True)
    assert state["memory"] == {"micro_batch_size": 2, "activation_checkpointing": False, "cpu_offload": False}
    assert json.loads((tmp_path / "oom" / "memory.json").read_text())["micro_batch_size"] == 2
    # A resume starts there, even with the memory problem gone.
    _, again, _ = train_tiny_gpt(tmp_path / "oom", data, micro=8, global_=16, steps=8, **{"checkpoint.resume": "auto"})
    assert again.micro_batch_size == 2
    (tmp_path / "oom" / "memory.json").unlink()  # the checkpoint alone carries it too
    _, again, _ = train_tiny_gpt(tmp_path / "oom", data, micro=8, global_=16, steps=9, **{"checkpoint.resume": "auto"})
    assert again.micro_batch_size == 2


def test_activation_checkpointing_is_the_rung_after_micro_batch_one(tmp_path):
    data = token_sequences(tmp_path)
    ref, _, _ = train_tiny_gpt(tmp_path / "ref", data, micro=1, global_=4, steps=4)
    faults = _oom_above(0, 2, **{"debug.oom_unless_checkpointing": "true"})
    model, trainer, _ = train_tiny_gpt(tmp_path / "ac", data, micro=4, global_=4, steps=4, **faults)
    assert trainer.ladder.rung == Rung(1, activation_checkpointing=True)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_oom_at_micro_batch_one_saves_and_reports(tmp_path):
    data = token_sequences(tmp_path)
    with pytest.raises(OutOfMemoryExhausted) as info:
        train_tiny_gpt(tmp_path / "x", data, micro=4, global_=8, steps=6, **_oom_above(0, 3))
    report = str(info.value)
    assert "out of memory at step 4 with micro-batch 1 + activation checkpointing" in report
    for tried in ("micro-batch 4:", "micro-batch 2:", "micro-batch 1:", "micro-batch 1 + activation checkpointing:"):
        assert tried in report
    assert "saved" in report
    path = latest_checkpoint(tmp_path / "x" / "checkpoints")
    assert path.name.endswith("00000003")  # the last completed step, nothing half-applied
    _, state = load_checkpoint(path, with_state=True)
    assert state["memory"] == {"micro_batch_size": 1, "activation_checkpointing": True, "cpu_offload": False}


def test_auto_micro_batch_finds_the_threshold(tmp_path):
    data = token_sequences(tmp_path)
    _, trainer, _ = train_tiny_gpt(tmp_path / "free", data, micro="auto", global_=24, steps=1)
    assert trainer.micro_batch_size == 24  # nothing limits it on the CPU: no accumulation
    model, trainer, _ = train_tiny_gpt(tmp_path / "probe", data, micro="auto", global_=24, steps=3, **_oom_above(5))
    assert trainer.micro_batch_size == 4  # the largest divisor of 24 that is at most 5
    event = next(r for r in _records(tmp_path / "probe") if r.get("event") == "micro_batch_size")
    assert event["micro_batch_size"] == 4 and "accumulation 6" in event["message"]
    # Probing changed nothing the run computes: same weights as a run told micro-batch 4.
    ref, _, _ = train_tiny_gpt(tmp_path / "ref", data, micro=4, global_=24, steps=3)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_cli_exits_non_zero_with_the_report(tmp_path, corpus_dir):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, corpus_dir, train__max_steps=6, checkpoint__every=0)
    proc = in_process("train", *sets(overrides), *sets(["debug.oom_above=0", "debug.oom_from_step=2"]), check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "kiln: out of memory at step 3 with micro-batch 1 + activation checkpointing" in proc.stderr
    assert "Tried:" in proc.stderr and "kiln plan" in proc.stderr
    assert latest_checkpoint(run_dir / "checkpoints").name.endswith("00000002")
    (run_dir / "memory.json").write_text("{not json")
    proc = in_process("train", *sets(overrides), check=False)
    assert proc.returncode == 2 and "memory.json: not a kiln memory rung file" in proc.stderr
