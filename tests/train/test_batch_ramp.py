"""A global batch that grows in stages: the logged batch follows the ramp, and a run killed in the
middle of it resumes bitwise-identically."""

import json
import time

import pytest
import torch

from kiln.config import ConfigError, TrainConfig, load_config
from kiln.data.batch_schedule import BatchSchedule
from kiln.train.run import load_run

from conftest import tiny_overrides, token_sequences, train_tiny_gpt
from kilnrun import forked, in_process


def test_schedule_by_steps_and_by_tokens():
    by_steps = BatchSchedule.from_config(TrainConfig(global_batch_size=8, batch_ramp_start=2, batch_ramp_steps=10), 16)
    assert [by_steps.batch_size(s) for s in range(12)] == [2, 2, 2, 4, 4, 4, 6, 6, 6, 6, 8, 8]
    assert by_steps.samples_before(12) == 3 * 2 + 3 * 4 + 4 * 6 + 2 * 8
    # 4800 tokens over stages of 2, 4 and 6 sequences of 16 tokens: 1600 tokens each, rounded up
    # to whole steps: 50, 25 and 17 steps.
    by_tokens = BatchSchedule.from_config(
        TrainConfig(global_batch_size=8, batch_ramp_start=2, batch_ramp_tokens=4800), 16
    )
    assert by_tokens.ramp_steps == 50 + 25 + 17
    assert by_tokens.batch_size(49) == 2 and by_tokens.batch_size(50) == 4 and by_tokens.batch_size(92) == 8
    assert BatchSchedule.from_config(TrainConfig(global_batch_size=8), 16).sizes() == [8]


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.batch_ramp_start=3", "train.batch_ramp_steps=10"], "batch_ramp_increment: 3 does not divide"),
        (["train.batch_ramp_start=4"], "set exactly one of them"),
        (["train.batch_ramp_start=4", "train.batch_ramp_steps=5", "train.batch_ramp_tokens=5"], "set exactly one"),
        (["train.batch_ramp_start=40", "train.batch_ramp_steps=5"], "must be below train.global_batch_size"),
        (["train.batch_ramp_steps=5"], "train.batch_ramp_steps: set, but the ramp is off"),
        (
            ["train.micro_batch_size=4", "train.batch_ramp_start=2", "train.batch_ramp_steps=5"],
            "train.batch_ramp_start: 2 is not a multiple of train.micro_batch_size 4",
        ),
    ],
)
def test_bad_ramps_are_named(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=1", *sets])


def test_logged_global_batch_and_tokens_follow_the_ramp(tmp_path):
    data = token_sequences(tmp_path)
    _, _, result = train_tiny_gpt(
        tmp_path / "r",
        data,
        micro=2,
        global_=8,
        steps=12,
        **{"train.batch_ramp_start": 2, "train.batch_ramp_steps": 10},
    )
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["global_batch"] for r in steps] == [2, 2, 2, 4, 4, 4, 6, 6, 6, 6, 8, 8]
    assert [r["tokens"] for r in steps][-1] == (3 * 2 + 3 * 4 + 4 * 6 + 2 * 8) * data.seq_len
    assert result.step == 12


@pytest.mark.slow
def test_sigkill_mid_ramp_resumes_bitwise(tmp_path, corpus_dir):
    steps, ramp = 160, 150  # stages of 2, 4 and 6 sequences, 50 steps each, then 8

    def cmd(run_dir):
        items = tiny_overrides(
            run_dir,
            corpus_dir,
            train__max_steps=steps,
            train__micro_batch_size=2,
            train__global_batch_size=8,
            train__batch_ramp_start=2,
            train__batch_ramp_steps=ramp,
            checkpoint__every=7,
            eval__sample_tokens=0,
        )
        return ["train", *[a for i in items for a in ("--set", i)]]

    def logged(run_dir):
        path = run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return {r["step"]: r for r in map(json.loads, lines[:-1]) if "loss" in r}  # the last line may be partial

    ref = tmp_path / "uninterrupted"
    in_process(*cmd(ref))
    run_dir = tmp_path / "killed"
    proc = forked(*cmd(run_dir))
    deadline = time.time() + 120
    while time.time() < deadline and max(logged(run_dir), default=0) < 60:
        time.sleep(0.01)
    proc.kill()  # SIGKILL
    proc.join()
    killed_at = max(logged(run_dir))
    assert 60 <= killed_at < ramp, "the kill should land in the middle of the ramp"
    out = in_process(*cmd(run_dir)).stdout
    assert "resumed from" in out
    got, want = logged(run_dir), logged(ref)
    assert [got[s]["global_batch"] for s in range(1, steps)] == [want[s]["global_batch"] for s in range(1, steps)]
    assert [got[s]["loss"] for s in range(killed_at, steps)] == [want[s]["loss"] for s in range(killed_at, steps)]
    for (name, a), b in zip(
        load_run(run_dir).model.state_dict().items(), load_run(ref).model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
