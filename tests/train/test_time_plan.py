"""train.max_steps = "auto": the steps that fill train.time_budget, planned from a probe that
leaves no trace, recorded in the run and kept on resume."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
from safetensors.torch import load_file

from kiln.checkpoint import checkpoint_step
from kiln.config import ConfigError, load_config, tomllib
from kiln.data.batch_schedule import BatchSchedule
from kiln.distributed.world import World
from kiln.observe import NullLogger
from kiln.train.run import find_checkpoint
from kiln.train.time_plan import REFERENCE_RUN_TOKENS, Costs, TimePlan, choose_batch

from conftest import tiny_overrides
from kilnrun import forked, in_process, kiln, sets


def _plan(budget_s, **sets):
    cfg = load_config(None, ["train.max_steps=auto", f"train.time_budget={budget_s}s", *sets.values()])
    return TimePlan(cfg, BatchSchedule(32), 128)


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


def test_a_planned_run_ends_when_it_has_read_its_data_max_epochs_times():
    """On a small corpus the budget would buy many passes; the plan stops at data.max_epochs of
    them (and says so), corrections included, and a batch chosen from the budget is chosen for
    the tokens those passes hold."""
    cfg = load_config(None, ["train.max_steps=auto", "train.time_budget=100s", "data.max_epochs=3"])
    costs = Costs(step_s=0.01, eval_s=0.1, save_s=0.1, start_s=0.1)
    plan = TimePlan(cfg, BatchSchedule(32), 128, data=range(1000))
    assert plan.fix(costs, elapsed_s=1) == 94 == plan.passes_steps()  # 3 x 1,000 sequences, 32 a step
    assert plan.data_bound and "1,000 training sequences 3 times (data.max_epochs)" in plan.describe()
    assert plan.correct(47, 0.005, 2.0) == 94  # faster steps do not add passes
    # A larger corpus: the budget ends the run first, as before.
    big = TimePlan(cfg, BatchSchedule(32), 128, data=range(10**7))
    assert big.fix(costs, elapsed_s=1) > 94 and not big.data_bound and "fill the 100s" in big.describe()
    # A batch ramp: the passes end where the ramp's and the final batches have held them.
    ramp = TimePlan(cfg, BatchSchedule(32, [(8, 100)]), 128, data=range(1000))
    assert ramp.passes_steps() == 100 + 69  # 800 in the ramp, 2,200 more at 32 a step
    # Each batch trained on for 2 steps in a row (grpo.iterations=2): twice the steps per pass.
    assert TimePlan(cfg, BatchSchedule(32), 128, data=range(1000), repeat=2).passes_steps() == 2 * 94
    # An iterable of unknown length: no end but the budget.
    assert TimePlan(cfg, BatchSchedule(32), 128, data=None).passes_steps() is None


def test_a_planned_run_on_a_small_corpus_stops_after_its_passes(tmp_path, short_documents):
    """End to end: a minute's budget on a corpus it reads in a few seconds stops after
    data.max_epochs passes (one here), the schedule ending there (its final rate), long before the budget;
    the batch is chosen for those passes' tokens."""
    run = tmp_path / "run"
    common = dict(
        train__max_steps="auto",
        train__time_budget="60s",
        train__global_batch_size="auto",
        data__max_epochs=1,
        checkpoint__every=0,
        eval__sample_tokens=0,
    )
    started = time.perf_counter()
    in_process("train", *sets(tiny_overrides(run, short_documents, **common)))
    records = _records(run)
    [plan] = [r for r in records if r.get("event") == "time_plan"]
    assert "times (data.max_epochs)" in plan["message"]
    steps = tomllib.loads((run / "config.toml").read_text())["train"]["max_steps"]
    batch = tomllib.loads((run / "config.toml").read_text())["train"]["global_batch_size"]
    sequences = int(re.search(r"its ([\d,]+) training sequences", plan["message"])[1].replace(",", ""))
    assert steps == -(-sequences // batch)  # one pass, rounded up to a whole step
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == steps and last["lr"] == pytest.approx(1e-2 * 0.1)
    assert time.perf_counter() - started < 40


def test_a_first_estimate_is_corrected_by_the_run_s_own_timed_steps():
    """The probe's rough pace plans the run; its first steps after their warm-up are timed as
    long as the probe would have timed them, and their pace fixes the plan, which is then
    corrected halfway as usual."""
    plan = _plan(100, eval="eval.every=5000", save="checkpoint.every=5000")
    estimate = plan.fix(Costs(step_s=0.05, eval_s=2.0, save_s=1.0, start_s=0.5), elapsed_s=4, first_estimate=True)
    assert plan.correct_at is None and "a first estimate" in plan.describe()
    plan.loop_starts(0, elapsed_s=4)
    assert plan.correct_at == estimate // 2  # at the latest
    assert not plan.due(1, 4.4) and plan.timed is None  # warming up
    assert not plan.due(10, 5.5) and plan.timed == (10, 5.5)  # two steps and 0.5 s: warm, timed from here
    # The run's steps take 0.08 s, not the estimate's 0.05: timed for the probe's 2 s, then corrected.
    assert not plan.due(34, 5.5 + 24 * 0.08)
    assert plan.due(36, 5.5 + 26 * 0.08)
    plan.correct_pace(World(), 36, 5.5 + 26 * 0.08, NullLogger())
    fixed = plan.max_steps
    # The rest of the 96 s holds steps of 0.08 s and the final evaluation and checkpoint.
    assert fixed < estimate and fixed == pytest.approx(36 + (96 - 5.5 - 26 * 0.08 - 2.0 - 1.0) / 0.08, abs=1)
    assert plan.correct_at == 36 + (fixed - 36) // 2 and "a first estimate" not in plan.describe()


def test_the_step_that_compiles_starts_the_timing_again():
    """With train.compile_after the plan is fixed by the compiled steps' pace: the step that
    compiles (25 s here) starts the warm-up and the timing again, and its seconds count as spent."""
    plan = _plan(
        300,
        compile="train.compile=true",
        after="train.compile_after=20",
        eval="eval.every=5000",
        save="checkpoint.every=5000",
    )
    estimate = plan.fix(Costs(step_s=0.1, eval_s=1.0, save_s=0.5, start_s=0.5), elapsed_s=4, first_estimate=True)
    plan.loop_starts(0, elapsed_s=4)
    assert not plan.due(15, 5.5) and plan.timed == (15, 5.5)  # eager steps of 0.1 s, warm
    assert not plan.due(20, 6.0)
    assert not plan.due(21, 31.0) and plan.timed is None  # the compile: warming up again
    compiled = 31.0 + 19 * 0.08
    assert not plan.due(40, compiled) and plan.timed == (40, compiled)  # compiled steps of 0.08 s
    assert not plan.due(110, compiled + 70 * 0.08)
    assert plan.due(115, compiled + 75 * 0.08)
    plan.correct_pace(World(), 115, compiled + 75 * 0.08, NullLogger())
    left = 300 * 0.96 - (compiled + 75 * 0.08) - 1.0 - 0.5
    assert plan.max_steps != estimate and plan.max_steps == pytest.approx(115 + left / 0.08, abs=2)


def test_compile_auto_compiles_a_planned_run_of_two_minutes_or_more_after_its_first_steps():
    def resolved(*sets):
        train = load_config(None, list(sets)).train
        return train.compile_resolved("lm", 1), train

    default, given = resolved()
    assert given.compile == "auto" and (default.compile, default.compile_after) == (True, 20)
    for short in (
        ["train.time_budget=45s"],  # the compile would not be repaid
        ["train.max_steps=500"],
        ["train.schedule=cosine"],  # planned in full before the run: the plan would time eager steps
    ):
        assert resolved(*short)[0].compile is False, short
    assert given.compile_resolved("sft", 1).compile is False
    assert given.compile_resolved("lm", 2).compile is False  # a pipeline compiles its blocks
    assert resolved("train.compile=true")[0].compile_after == 0
    assert (resolved("train.compile=false")[0].compile, resolved("train.compile=false")[0].compile_after) == (False, 0)


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.compile=false", "train.compile_after=5"], "train.compile is false"),
        (["train.compile=true", "train.compile_after=5", "train.schedule=cosine"], "train.schedule is cosine"),
        (["train.compile=true", "train.compile_after=-1"], "must be >= 0"),
    ],
)
def test_compile_after_refuses_what_it_cannot_do(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_a_first_estimate_too_short_to_time_is_corrected_halfway():
    plan = _plan(100)
    steps = plan.fix(Costs(step_s=10.0, eval_s=2.0, save_s=1.0, start_s=0.5), elapsed_s=4, first_estimate=True)
    plan.loop_starts(0, elapsed_s=4)
    assert steps == 8 and plan.correct_at == 4 and plan.due(4, 44.0)


def test_no_correction_comes_after_the_decay_has_started():
    """Every step before a correction must have trained at the rate of the corrected plan."""
    plan = _plan(100)
    plan.fix(Costs(step_s=0.05, eval_s=2.0, save_s=1.0, start_s=0.5), elapsed_s=4)
    half = plan.correct_at
    assert half is not None
    steps = plan.correct(half, 0.09, elapsed_s=4 + half * 0.09)  # much slower: the decay comes soon
    decay_start = steps - round(0.2 * steps)
    assert half <= decay_start and plan.correct_at == decay_start < half + (steps - half) // 2


def test_schedules_whose_rate_depends_on_the_length_are_not_corrected():
    plan = _plan(100, schedule="train.schedule=cosine")
    plan.fix(Costs(step_s=0.5, eval_s=2.0, save_s=1.0, start_s=0.5), elapsed_s=10)
    assert plan.correct_at is None


def test_a_budget_too_short_still_plans_one_step():
    plan = _plan(1)
    assert plan.fix(Costs(step_s=5.0, eval_s=5.0, save_s=5.0, start_s=0.0), elapsed_s=0.5) == 1


def test_the_default_plan_fills_five_minutes_and_a_number_of_steps_has_no_budget():
    assert load_config(None, []).train.max_steps == "auto"
    assert _plan(300).budget_s == 300
    assert TimePlan(load_config(None, []), BatchSchedule(32), 128).budget_s == 300
    fixed = load_config(None, ["train.max_steps=1050"])
    assert fixed.train.budget == "" and TimePlan(fixed, BatchSchedule(32), 128).budget_s == float("inf")


def test_the_auto_batch_grows_as_the_square_root_of_the_run_s_tokens():
    # The reference point: 16 sequences of 128 tokens for a run of the reference's tokens.
    assert choose_batch(REFERENCE_RUN_TOKENS, 128, micro=32, data_ranks=1) == 16
    assert choose_batch(REFERENCE_RUN_TOKENS / 16, 128, micro=32, data_ranks=1) == 4  # a smaller micro-batch
    assert choose_batch(REFERENCE_RUN_TOKENS / 10, 128, micro=32, data_ranks=1) == 4  # 5.06 a rank: rounded down
    assert choose_batch(REFERENCE_RUN_TOKENS / 1.1, 128, micro=32, data_ranks=1) == 8  # 15.3: rounded down
    assert choose_batch(REFERENCE_RUN_TOKENS * 16, 128, micro=32, data_ranks=1) == 64  # accumulation of 2
    assert choose_batch(REFERENCE_RUN_TOKENS * 15, 128, micro=32, data_ranks=1) == 32  # 62: one micro-batch
    assert choose_batch(REFERENCE_RUN_TOKENS * 64, 128, micro=32, data_ranks=2) == 128  # 2 ranks x 2 x 32
    assert choose_batch(REFERENCE_RUN_TOKENS * 64, 128, micro=16, data_ranks=2) == 128  # 2 ranks x 4 x 16
    assert choose_batch(1.0, 128, micro=32, data_ranks=4) == 4  # never below a sequence a rank


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.micro_batch_size=auto"], "auto needs a number for train.micro_batch_size"),
        (["train.batch_ramp_start=8", "train.batch_ramp_steps=10"], "set train.batch_ramp_start = 0"),
    ],
)
def test_auto_batch_refuses_what_it_cannot_choose_with(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.global_batch_size=auto", *sets])


def test_with_a_number_of_steps_the_auto_batch_is_the_recipe_s_32():
    cfg = load_config(None, ["train.max_steps=100"])
    assert cfg.train.global_batch_size == "auto" and not cfg.train.chooses_batch and cfg.train.global_batch(2) == 32
    assert cfg.grad_accum_steps() == 1


def _records(run):
    """The run's metrics.jsonl (its complete lines: the run may be writing it)."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


@pytest.mark.slow
def test_auto_fills_the_budget_ends_the_schedule_and_resumes_exactly(tmp_path, corpus_dir, alone):
    """A planned run ends its schedule at its last step, inside the budget; the probe leaves no
    trace (the same steps given as a number train the same weights); SIGKILL + resume keeps the
    planned steps and ends bitwise equal."""
    budget = 5
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
    with alone():
        started = time.perf_counter()
        out = kiln("train", *sets(tiny_overrides(auto, corpus_dir, **common))).stdout
        wall = time.perf_counter() - started
    steps = tomllib.loads((auto / "config.toml").read_text())["train"]["max_steps"]
    assert isinstance(steps, int) and steps > 20
    records = _records(auto)
    [plan] = [r for r in records if r.get("event") == "time_plan"]
    corrected = [r for r in records if r.get("event") == "time_replan"]
    assert (corrected or [plan])[-1]["max_steps"] == steps and plan["step_s"] > 0 and len(corrected) <= 3
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == steps
    assert last["lr"] == pytest.approx(1e-2 * 0.1)  # the schedule's final value, train.lr x min_lr_ratio
    # It fills the budget to within a tenth, an evaluation every 40 steps and a checkpoint every
    # 10 included, and stays under it by no more than the plan's margin.
    assert abs(last["elapsed_s"] - budget) <= 0.1 * budget and last["elapsed_s"] <= budget * 1.05
    assert wall < budget + 10  # the interpreter's start and the data's fingerprint come on top
    # The probe's checkpoint is gone, and was not announced.
    assert not (auto / "checkpoints" / "step-00000000").exists() and "step-00000000" not in out
    assert f"saved checkpoint {auto / 'checkpoints' / f'step-{steps:08d}'}" in out

    fixed = tmp_path / "fixed"
    overrides = tiny_overrides(fixed, corpus_dir, **{**common, "train__max_steps": steps, "train__time_budget": ""})
    in_process("train", *sets(overrides))
    final = f"checkpoints/step-{steps:08d}/model.safetensors"
    a, b = load_file(auto / final), load_file(fixed / final)
    assert all((a[k] == b[k]).all() for k in a)

    killed = tmp_path / "killed"
    args = ["train", *sets(tiny_overrides(killed, corpus_dir, **common))]
    proc = forked(*args)
    deadline, replanned = time.time() + 60, None
    while time.time() < deadline:  # until a checkpoint after the plan's first correction
        events = [r for r in _records(killed) if r.get("event") == "time_replan"]
        replanned = replanned or (events[0]["step"] if events else None)
        if replanned and any(int(p.name[5:]) > replanned for p in (killed / "checkpoints").glob("step-*")):
            break
        time.sleep(0.02)
    proc.kill()  # SIGKILL
    proc.join()
    resume_at = checkpoint_step(find_checkpoint(killed)[1])
    assert replanned is not None and resume_at > replanned
    plans = [r for r in _records(killed) if r.get("event") in ("time_plan", "time_replan") and r["step"] <= resume_at]
    planned = plans[-1]["max_steps"]
    in_process(*args)
    # The resumed run keeps the plan of its checkpoint, corrected once already.
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
def test_an_auto_batch_is_chosen_recorded_and_kept_on_resume(tmp_path, corpus_dir, alone):
    """global_batch_size = "auto": the probe chooses the batch and leaves no trace (the same steps
    and batch given as numbers train the same weights); a resumed run keeps the batch."""
    common = dict(
        train__max_steps="auto",
        train__global_batch_size="auto",
        train__micro_batch_size=64,  # the probe's batch; a short run chooses a smaller one
        train__time_budget="6s",
        train__log_every=5,
        checkpoint__every=4,  # resumed from step 4: before any decay of a plan of 6 steps or more
        checkpoint__keep=1000,
        eval__sample_tokens=0,
    )
    auto = tmp_path / "auto"
    with alone():  # it ends at its plan, not on the budget's hard stop
        in_process("train", *sets(tiny_overrides(auto, corpus_dir, **common)))
    train = tomllib.loads((auto / "config.toml").read_text())["train"]
    steps, batch = train["max_steps"], train["global_batch_size"]
    [plan] = [r for r in _records(auto) if r.get("event") == "time_plan"]
    assert isinstance(batch, int) and plan["global_batch"] == batch and f"of {batch} sequences" in plan["message"]
    assert {r["global_batch"] for r in _records(auto) if "loss" in r} == {batch}
    assert train["micro_batch_size"] == min(64, batch)  # the run's config loads again (kiln eval)
    assert json.loads(in_process("eval", auto).stdout.strip().splitlines()[-1])["step"] == steps

    fixed = tmp_path / "fixed"
    assert batch < 64
    micro = min(64, batch)  # a batch below the micro-batch is one micro-batch
    numbers = {"train__max_steps": steps, "train__global_batch_size": batch, "train__time_budget": ""}
    in_process(
        "train", *sets(tiny_overrides(fixed, corpus_dir, **{**common, **numbers, "train__micro_batch_size": micro}))
    )
    final = f"checkpoints/step-{steps:08d}/model.safetensors"
    a = load_file(auto / final)
    assert all((a[k] == v).all() for k, v in load_file(fixed / final).items())

    # Resume from the first checkpoint: the planned batch comes back with the plan.
    for later in sorted((auto / "checkpoints").glob("step-*"))[1:]:
        shutil.rmtree(later)
    with alone():
        in_process("train", *sets(tiny_overrides(auto, corpus_dir, **common)))
    assert {r["global_batch"] for r in _records(auto) if "loss" in r} == {batch}
    # The plan at step 4 was still the probe's first estimate: the resumed run plans its own
    # budget from there, and trains as the same steps given as a number would.
    train = tomllib.loads((auto / "config.toml").read_text())["train"]
    assert train["global_batch_size"] == batch
    again = tmp_path / "fixed-again"
    numbers["train__max_steps"] = train["max_steps"]
    in_process(
        "train", *sets(tiny_overrides(again, corpus_dir, **{**common, **numbers, "train__micro_batch_size": micro}))
    )
    final = f"checkpoints/step-{train['max_steps']:08d}/model.safetensors"
    a = load_file(auto / final)
    assert all((a[k] == v).all() for k, v in load_file(again / final).items())
