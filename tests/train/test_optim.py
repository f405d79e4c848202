import math

import pytest
import torch
from torch import nn

from kiln.config import TrainConfig
from kiln.train.optim import build_optimizer, lr_at, param_groups


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_weight_decay_only_on_matrices():
    net = Net()
    decay, no_decay = param_groups(net, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(net.lin.weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(net.emb.weight),
        id(net.lin.bias),
        id(net.norm.weight),
        id(net.norm.bias),
    }


def test_optimizer_covers_each_parameter_once():
    net = Net()
    opt = build_optimizer(net, TrainConfig(), torch.device("cpu"))
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(net.parameters()))


def _cfg(**kw):
    base = dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=110)
    base.update(kw)
    return TrainConfig(**base)


def test_warmup_is_linear_from_zero():
    cfg = _cfg()
    assert [lr_at(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_reaches_floor_at_the_last_step(schedule):
    cfg = _cfg(schedule=schedule, max_steps=111)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(110, cfg) == pytest.approx(0.1)  # the last step, max_steps - 1
    assert lr_at(109, cfg) > 0.1
    mid = lr_at(60, cfg)
    assert mid == pytest.approx(0.55 if schedule == "linear" else 0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_constant_and_wsd():
    assert lr_at(100, _cfg(schedule="constant")) == 1.0
    wsd = _cfg(schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, wsd) == 1.0 and lr_at(87, wsd) == 1.0
    assert lr_at(109, wsd) == pytest.approx(0.1)
    assert 0.1 < lr_at(100, wsd) < 1.0
