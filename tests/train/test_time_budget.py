import json
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from kiln import Trainer
from kiln.config import ConfigError, load_config, parse_duration

STEP_S = 0.05


def _fit(run_dir, budget, max_steps=1000):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))

    def slow_loss(m, batch):  # a step of known length
        time.sleep(STEP_S)
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    cfg = load_config(
        None,
        [
            f"run.dir={run_dir}",
            f"train.time_budget={budget}",
            f"train.max_steps={max_steps}",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "train.log_every=1",
            "data.num_workers=0",
            "eval.every=0",
            "checkpoint.every=0",
            "run.device=cpu",
        ],
    )
    return Trainer(model, data, slow_loss, cfg, eval_fn=lambda m: {"val_loss": 1.0}, console=False).fit()


@pytest.mark.wallclock
def test_budget_stops_within_one_step_with_eval_and_checkpoint(tmp_path):
    result = _fit(tmp_path, "1s")
    assert result.out_of_time and 5 <= result.step < 1000
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last_train = [record for record in lines if "loss" in record][-1]
    assert last_train["step"] == result.step
    # It stopped within one step of the budget: one more step would have crossed it. (The last
    # step may end a hair past it when it took longer than the one before, which the check
    # used as its estimate.)
    assert 1.0 - 2 * STEP_S <= last_train["elapsed_s"] <= 1.0 + STEP_S
    assert lines[-1] == {"step": result.step, "val_loss": 1.0}
    assert (tmp_path / "checkpoints" / f"step-{result.step:08d}" / "manifest.json").exists()

    again = _fit(tmp_path, "1s")  # the same command extends the run by another budget
    assert again.resumed_from == result.step and again.step > result.step


def test_budget_longer_than_the_run_changes_nothing(tmp_path):
    result = _fit(tmp_path, "1h", max_steps=3)
    assert result.step == 3 and not result.out_of_time


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("5m", 300), ("1.5h", 5400), ("1h30m", 5400)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["5 minutes", "m5", "-3s", "0s"])
def test_bad_budget_names_the_key(bad):
    with pytest.raises(ConfigError, match="train.time_budget"):
        load_config(None, [f"train.time_budget={bad}"])


def test_precision_auto_is_fp32_on_the_cpu_and_recorded(tmp_path):
    assert load_config(None, []).train.precision == "auto"
    _fit(tmp_path, "1h", max_steps=1)
    assert 'precision = "fp32"' in (tmp_path / "config.toml").read_text()
