"""The non-finite guard: skip, locate, roll back, stop; and loss-spike warnings."""

import json
import math

import pytest
import torch

from kiln.config import GuardConfig
from kiln.train.guard import Guard, TrainingDiverged, first_non_finite_module
from kiln.train.precision import Precision

from conftest import tiny_overrides, token_sequences, train_tiny_gpt
from kilnrun import in_process, sets


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_device_side_skip_leaves_weights_and_optimizer_state_alone():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    precision = Precision("fp32", torch.device("cpu"))
    p.grad = torch.ones(4)
    precision.step(opt, finite=torch.tensor(True))
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    p.grad = torch.full((4,), math.nan)
    precision.step(opt, finite=torch.tensor(False))
    assert torch.equal(p, before[0])
    assert all(torch.equal(v, opt.state[p][k]) for k, v in before[1].items())  # step count too
    assert not hasattr(opt, "found_inf")


def test_nan_step_is_skipped_located_and_the_run_goes_on(tmp_path):
    data = token_sequences(tmp_path)
    faults = {"debug.nan_steps": "4", "debug.nan_module": "blocks.1.attn"}
    model, trainer, result = train_tiny_gpt(
        tmp_path / "nan", data, micro=4, global_=8, steps=8, **{"train.log_every": 3}, **faults
    )
    assert result.step == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
    records = _records(tmp_path / "nan")
    event = next(r for r in records if r.get("event") == "non_finite")
    assert event["steps"] == [4] and event["module"] == "blocks.1.attn"
    assert "module 'blocks.1.attn'" in event["message"]
    logged = [r for r in records if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in logged)  # the interval's mean leaves the bad step out
    assert logged[1]["nonfinite_steps"] == 1
    # The update of step 4 was not applied: AdamW counted 7 steps of 8.
    assert trainer.optimizer.state[trainer.train_step.params[0]]["step"].item() == 7


def test_a_non_finite_expert_is_named_with_its_layer():
    from kiln.config import ModelConfig
    from kiln.models.gpt import GPT, build_gpt_config

    torch.manual_seed(0)
    cfg = build_gpt_config(ModelConfig(preset="tiny-moe", d_model=32, n_head=4, d_expert=16, d_ff=48), 97, 32)
    model = GPT(cfg)
    tokens = torch.randint(0, 97, (4, 32))
    assert first_non_finite_module(model, lambda: model(tokens)) is None
    experts = model.blocks[2].mlp.experts
    with torch.no_grad():
        experts.w1[5, 0, 0] = math.nan  # one weight of expert 5: every row it computes
    assert first_non_finite_module(model, lambda: model(tokens)) == "blocks.2.mlp.experts (expert 5)"
    with torch.no_grad():
        experts.w2[3] = math.inf
    assert first_non_finite_module(model, lambda: model(tokens)) == "blocks.2.mlp.experts (2 experts: 3, 5)"
    with torch.no_grad():
        experts.w3.fill_(math.inf)
    assert first_non_finite_module(model, lambda: model(tokens)) == "blocks.2.mlp.experts (all 8 experts)"


def test_repeated_nan_rolls_back_with_a_lower_learning_rate(tmp_path):
    data = token_sequences(tmp_path)
    model, trainer, result = train_tiny_gpt(
        tmp_path / "rb",
        data,
        micro=4,
        global_=8,
        steps=14,
        **{"checkpoint.every": 5, "guard.max_bad_steps": 3, "guard.lr_factor": 0.25, "debug.nan_steps": "7,8,9"},
    )
    assert result.step == 14 and all(torch.isfinite(p).all() for p in model.parameters())
    records = _records(tmp_path / "rb")
    rollback = next(r for r in records if r.get("event") == "rollback")
    assert rollback["step"] == 5 and rollback["lr_scale"] == 0.25
    logged = {r["step"]: r for r in records if "loss" in r}
    assert sorted(logged) == list(range(1, 15))  # one line per step: the redone steps replaced the bad ones
    assert all(math.isfinite(r["loss"]) for r in logged.values())
    assert logged[6]["lr"] == pytest.approx(1e-2 * 0.25)  # after the rollback, at a quarter of the rate
    assert trainer.guard.state_dict()["lr_scale"] == 0.25  # and it is saved with the checkpoints


def test_nan_that_persists_stops_with_a_report(tmp_path, corpus_dir):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        run_dir,
        corpus_dir,
        train__max_steps=20,
        checkpoint__every=3,
        guard__max_bad_steps=2,
        guard__max_rollbacks=1,
        debug__nan_steps="5,6,7,8,9,10",
        debug__nan_persist="true",
    )
    proc = in_process("train", *sets(overrides), check=False)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "non-finite steps in a row again after 1 rollback" in proc.stderr and "Lower train.lr" in proc.stderr
    assert "rolled back to step-00000003" in proc.stdout


def test_loss_spikes_are_reported_with_their_batch():
    guard = Guard(GuardConfig(spike_threshold=6.0))
    calm = [3.0 + 0.01 * math.sin(i) for i in range(40)]
    review = guard.review(1, calm + [9.0] + calm[:5], [1.0] * 46)
    assert review.spikes == [(41, 9.0)] and not review.bad_steps and not review.rollback
    with pytest.raises(TrainingDiverged):
        Guard(GuardConfig(max_rollbacks=0)).start_rollback()


def test_the_loss_scale_halves_on_an_overflow_doubles_after_2000_finite_steps_and_resumes():
    from kiln.train.precision import LossScale

    cpu = torch.device("cpu")
    scale = LossScale(cpu, enabled=True)
    assert scale(torch.tensor(1.0)).item() == 2.0**16
    scale.update(torch.tensor(False))
    assert scale.scale.item() == 2.0**15 and int(scale.skipped) == 1
    for _ in range(1999):
        scale.update(torch.tensor(True))
    assert scale.scale.item() == 2.0**15 and int(scale.finite_steps) == 1999
    scale.update(torch.tensor(True))
    assert scale.scale.item() == 2.0**16 and int(scale.finite_steps) == 0
    resumed = LossScale(cpu, enabled=True)
    resumed.load_state_dict(scale.state_dict())
    assert resumed.state_dict() == scale.state_dict() == {"scale": 2.0**16, "finite_steps": 0, "skipped": 1}
    off = LossScale(cpu, enabled=False)
    off.update(torch.tensor(False))
    assert off(torch.tensor(3.0)).item() == 3.0 and off.scale.item() == 1.0


def test_fp16_overflow_is_the_scalers_business():
    fp16 = Guard(GuardConfig(max_bad_steps=2), scaler_skips=True)
    review = fp16.review(1, [5.0, 5.0, 5.0], [math.inf, math.inf, math.inf])  # scaler skips while it finds its scale
    assert not review.bad_steps and not review.rollback
    review = fp16.review(4, [math.nan, math.nan], [math.nan, math.nan])  # the forward pass itself went NaN
    assert review.bad_steps == [4, 5] and review.rollback


def test_loss_spike_in_a_run_is_logged_with_step_and_batch(tmp_path):
    from torch.utils.data import TensorDataset

    from kiln import Trainer
    from kiln.config import load_config

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    calls = []

    def loss_fn(m, batch):  # one micro-batch per step: call 31 is step 31
        calls.append(1)
        loss = torch.nn.functional.mse_loss(m(batch[0]), batch[1])
        return loss * 100 if len(calls) == 31 else loss

    cfg = load_config(
        None,
        [
            f"run.dir={tmp_path}",
            "train.max_steps=40",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "train.lr=1e-3",
            "train.warmup_steps=1",
            "train.log_every=10",
            "data.num_workers=0",
            "checkpoint.every=0",
            "run.device=cpu",
        ],
    )
    Trainer(model, data, loss_fn, cfg, console=False).fit()
    spikes = [r for r in _records(tmp_path) if r.get("event") == "loss_spike"]
    assert [s["step"] for s in spikes] == [31]
    assert spikes[0]["batch"] == [240, 248]  # sequences 240..247 of the data order
    assert "dataset items" in spikes[0]["message"]
