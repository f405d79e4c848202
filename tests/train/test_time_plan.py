"""train.max_steps = "auto": the steps that fill train.time_budget, planned from a probe that
leaves no trace, recorded in the run and kept on resume."""

from __future__ import annotations

import json
import signal
import time

import pytest
from safetensors.torch import load_file

from kiln.config import ConfigError, load_config, tomllib
from kiln.train.time_plan import Costs, TimePlan

from conftest import tiny_overrides
from kilnrun import in_process, kiln, sets, start


def _plan(budget_s, **sets):
    cfg = load_config(None, ["train.max_steps=auto", f"train.time_budget={budget_s}s", *sets.values()])
    return TimePlan(cfg)


def test_the_plan_is_the_most_steps_that_fit():
    plan = _plan(100, eval="eval.every=10", save="checkpoint.every=25")
    costs = Costs(step_s=0.5, eval_s=2.0, save_s=1.0, start_s=0.5)
    steps = plan.fix(costs, elapsed_s=10)
    room = 100 * 0.96 - 10
    assert plan.cost_s(steps, costs) <= room < plan.cost_s(steps + 1, costs)
    # 0.5 s a step, an evaluation every 10 steps (0.2 s a step), a checkpoint every 25 (0.04 s);
    # the loader's start, and the final evaluation and checkpoint (at most one of each extra).
    assert steps == pytest.approx((room - 0.5 - 2.0 - 1.0) / 0.74, abs=3)
    assert plan.state_dict()["max_steps"] == steps


def test_halfway_the_plan_is_corrected_with_the_pace_kept():
    plan = _plan(100, eval="eval.every=10", save="checkpoint.every=25")
    costs = Costs(step_s=0.5, eval_s=2.0, save_s=1.0, start_s=0.5)
    steps = plan.fix(costs, elapsed_s=10)
    assert plan.correct_at == steps // 2
    # Steps turned out 20% faster: the rest of the budget holds more of them.
    half = plan.correct_at
    elapsed = 10 + plan.cost_s(half, Costs(0.4, 2.0, 1.0, 0.5))
    more = plan.correct(half, 0.4, elapsed)
    assert more > steps and plan.max_steps == more and plan.correct_at == half + (more - half) // 2
    assert elapsed + plan.cost_s(more, Costs(0.4, 2.0, 1.0, 0.5)) - plan.cost_s(half, Costs(0.4, 2.0, 1.0, 0.5)) <= 96
    # Much slower: fewer steps, but never so few that the decay should have begun already.
    plan.fix(costs, elapsed_s=10)
    fewer = plan.correct(half, 5.0, elapsed)
    assert fewer < steps and fewer - round(0.2 * fewer) >= half


def test_schedules_whose_rate_depends_on_the_length_are_not_corrected():
    plan = _plan(100, schedule="train.schedule=cosine")
    plan.fix(Costs(step_s=0.5, eval_s=2.0, save_s=1.0, start_s=0.5), elapsed_s=10)
    assert plan.correct_at is None


def test_a_budget_too_short_still_plans_one_step():
    plan = _plan(1)
    assert plan.fix(Costs(step_s=5.0, eval_s=5.0, save_s=5.0, start_s=0.0), elapsed_s=0.5) == 1


def test_auto_needs_a_budget():
    with pytest.raises(ConfigError, match="train.max_steps: auto plans the steps that fit train.time_budget"):
        load_config(None, ["train.max_steps=auto"])


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_auto_fills_the_budget_ends_the_schedule_and_resumes_exactly(tmp_path, corpus_dir):
    """A planned run ends its schedule at its last step, inside the budget; the probe leaves no
    trace (the same steps given as a number train the same weights); SIGKILL + resume keeps the
    planned steps and ends bitwise equal."""
    budget = 8
    common = dict(
        train__max_steps="auto",
        train__time_budget=f"{budget}s",
        train__log_every=5,
        train__warmup_steps=5,
        checkpoint__every=10,
        eval__every=40,
        eval__sample_tokens=0,
    )
    auto = tmp_path / "auto"
    started = time.perf_counter()
    kiln("train", *sets(tiny_overrides(auto, corpus_dir, **common)))
    wall = time.perf_counter() - started
    steps = tomllib.loads((auto / "config.toml").read_text())["train"]["max_steps"]
    assert isinstance(steps, int) and steps > 20
    records = _records(auto)
    [plan] = [r for r in records if r.get("event") == "time_plan"]
    corrected = [r for r in records if r.get("event") == "time_replan"]
    assert (corrected or [plan])[-1]["max_steps"] == steps and plan["step_s"] > 0 and len(corrected) <= 2
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == steps
    assert last["lr"] == pytest.approx(1e-2 * 0.1)  # the schedule's final value, train.lr x min_lr_ratio
    assert last["elapsed_s"] <= budget * 1.05
    assert wall < budget + 10  # the interpreter's start and the data's fingerprint come on top
    assert not (auto / "checkpoints" / "step-00000000").exists()  # the probe's checkpoint is gone

    fixed = tmp_path / "fixed"
    overrides = tiny_overrides(fixed, corpus_dir, **{**common, "train__max_steps": steps, "train__time_budget": ""})
    in_process("train", *sets(overrides))
    final = f"checkpoints/step-{steps:08d}/model.safetensors"
    a, b = load_file(auto / final), load_file(fixed / final)
    assert all((a[k] == b[k]).all() for k in a)

    killed = tmp_path / "killed"
    args = ["train", *sets(tiny_overrides(killed, corpus_dir, **common))]
    proc = start(*args)
    deadline = time.time() + 60
    while time.time() < deadline and not list((killed / "checkpoints").glob("step-0000002*")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    planned = tomllib.loads((killed / "config.toml").read_text())["train"]["max_steps"]
    in_process(*args)
    assert tomllib.loads((killed / "config.toml").read_text())["train"]["max_steps"] == planned
    again = [r for r in _records(killed) if "loss" in r][-1]
    assert again["step"] == planned
    # The same planned steps, uninterrupted, give the same weights.
    if planned != steps:
        fixed = tmp_path / "fixed-again"
        overrides = tiny_overrides(
            fixed, corpus_dir, **{**common, "train__max_steps": planned, "train__time_budget": ""}
        )
        in_process("train", *sets(overrides))
    final = f"checkpoints/step-{planned:08d}/model.safetensors"
    a, b = load_file(fixed / final), load_file(killed / final)
    assert all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow
def test_a_thirty_second_budget_ends_within_ten_percent(tmp_path, corpus_dir):
    budget = 30
    run = tmp_path / "run"
    overrides = tiny_overrides(
        run,
        corpus_dir,
        train__max_steps="auto",
        train__time_budget=f"{budget}s",
        train__log_every=10,
        eval__every=500,
        checkpoint__every=500,
    )
    started = time.perf_counter()
    kiln("train", *sets(overrides))
    wall = time.perf_counter() - started
    last = [r for r in _records(run) if "loss" in r][-1]
    # The interpreter's start comes on top of the loop's time.
    assert abs(last["elapsed_s"] - budget) <= 0.1 * budget and wall < budget * 1.1 + 15
    assert last["step"] == tomllib.loads((run / "config.toml").read_text())["train"]["max_steps"]
