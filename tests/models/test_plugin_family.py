"""A plug-in family that overrides only what it must (tests/toy_family.py: MINIMAL) is a
first-class citizen: it trains, is planned, checkpoints and resumes exactly, and every default
of the family interface (description, parallel plan, FLOPs, loss, evaluation) works for it."""

import re
import sys

import pytest
import torch

from kiln.config import load_config
from kiln.models import ModelFamily, get_family
from kiln.plan import make_plan, plan_json
from kiln.train.run import load_run
from kiln.train.trainer import train

from conftest import tiny_overrides
from kilnrun import in_process, losses

pytestmark = pytest.mark.e2e

MINIMAL = {"model.family": "toy_family:MINIMAL", "eval.sample_tokens": 0, "train.max_steps": 8}


def test_a_plugin_with_every_default_trains_plans_checkpoints_and_resumes(tmp_path, corpus_dir, capsys, monkeypatch):
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
    a, b = (load_run(r, device="cpu", trust=True).model.state_dict() for r in (run, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A run directory is data: the plug-in its config names is imported only with --trust-checkpoint.
    # Here the config of a run handed over names a module whose import would create a file.
    (tmp_path / "handed_family.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    config = run / "config.toml"
    config.write_text(config.read_text().replace('"toy_family:MINIMAL"', '"handed_family:FAMILY"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    for command in (["eval", run], ["generate", run], ["export", run, "--format", "hf", "--out", tmp_path / "x"]):
        proc = in_process(*command, check=False)
        assert proc.returncode == 2, proc.stderr
        assert (
            f"kiln: error: {config}: model.family = 'handed_family:FAMILY' is a plug-in: loading this run "
            in proc.stderr
        )
        assert (
            "imports and runs handed_family; pass --trust-checkpoint if you trust where the run comes from"
            in proc.stderr
        )
    assert not (tmp_path / "ran").exists() and not (tmp_path / "x").exists() and "handed_family" not in sys.modules
