"""A plug-in family that overrides only what it must (tests/toy_family.py: MINIMAL) is a
first-class citizen: it trains, is planned, checkpoints and resumes exactly, and every default
of the family interface (description, parallel plan, FLOPs, loss, evaluation) works for it."""

import re

import pytest
import torch

from kiln.config import load_config
from kiln.models import ModelFamily, get_family
from kiln.plan import make_plan, plan_json
from kiln.train.run import load_run
from kiln.train.trainer import train

from conftest import tiny_overrides
from kilnrun import losses

pytestmark = pytest.mark.e2e

MINIMAL = {"model.family": "toy_family:MINIMAL", "eval.sample_tokens": 0, "train.max_steps": 8}


def test_a_plugin_with_every_default_trains_plans_checkpoints_and_resumes(tmp_path, corpus_dir, capsys):
    family = get_family("toy_family:MINIMAL")
    overridden = {name for name in vars(type(family)) if not name.startswith("_")}
    assert overridden == {"resolve", "build", "args_to_dict", "args_from_dict", "memory_model"}
    assert all(name in vars(ModelFamily) for name in ("describe", "parallel_plan", "flops_per_token", "loss"))

    run = tmp_path / "run"
    result = train(load_config(None, tiny_overrides(run, corpus_dir, **MINIMAL)))
    assert re.search(r"kiln: model [\d,]+ parameters\n", capsys.readouterr().out)  # the default description
    got = losses(run)
    assert result.step == 8 and list(got) == list(range(1, 9)) and got[8] < got[1]
    assert result.eval_metrics["val_bpb"] > 0  # the default evaluation: the model's own loss

    plan = plan_json(make_plan(load_config(None, tiny_overrides(run, corpus_dir, **MINIMAL))))
    assert plan["memory"]["total"] > 0 and plan["time"]["flops_per_token"] > 0

    resumed = tmp_path / "resumed"
    sets = tiny_overrides(resumed, corpus_dir, **MINIMAL, checkpoint__resume=run / "checkpoints" / "step-00000004")
    train(load_config(None, sets), console=False)
    again = losses(resumed)
    assert list(again) == [5, 6, 7, 8] and all(again[s] == got[s] for s in again)
    a, b = (load_run(r, device="cpu").model.state_dict() for r in (run, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
