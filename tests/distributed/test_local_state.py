"""A sharded run started from a whole model's checkpoint keeps only its slices of it."""

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from kiln.checkpoint.store import StoredWeights
from kiln.distributed.parallel import load_whole

from kilnrun import spawn

pytestmark = pytest.mark.dist


def _whole(tmp_path, aliases=None):
    torch.manual_seed(0)
    weights = {"0.weight": torch.randn(16, 8), "0.bias": torch.randn(16), "1.weight": torch.randn(8, 16)}
    file = tmp_path / "model.safetensors"
    save_file(weights, str(file), metadata={"aliases": json.dumps(aliases or {})})
    optim = {
        "state": {name: {"step": torch.tensor(3.0), "exp_avg": torch.randn(t.shape)} for name, t in weights.items()},
        "param_groups": [{"lr": 0.1, "params": list(weights)}],
    }
    torch.save(optim, tmp_path / "optim.pt")
    return file, weights, optim


def _load(rank: int, world: int, root: str) -> None:
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    root_path = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{root_path / 'init'}", rank=rank, world_size=world)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8, bias=False))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        stored = StoredWeights(root_path / "model.safetensors")
        optim = load_whole(model, stored, torch.load(root_path / "optim.pt"))
        for name, param in model.state_dict().items():
            whole = stored[name]
            rows = whole.shape[0] // world
            assert isinstance(param, DTensor)
            assert torch.equal(param.to_local(), whole[rank * rows : (rank + 1) * rows]), name
            exp_avg = optim["state"][name]["exp_avg"]
            assert isinstance(exp_avg, DTensor) and exp_avg.placements == param.placements
            assert exp_avg.to_local().shape[0] == rows
            # Its own storage: a view would keep the whole tensor it was cut from.
            assert exp_avg.to_local().untyped_storage().nbytes() == exp_avg.to_local().nbytes
            assert not isinstance(optim["state"][name]["step"], DTensor)
        assert optim["param_groups"][0]["lr"] == 0.1
    finally:
        dist.destroy_process_group()


def test_stored_weights_are_read_on_access_under_every_name(tmp_path):
    # "2.weight" is a second name of "1.weight", as a tied weight is saved.
    file, weights, _ = _whole(tmp_path, {"2.weight": "1.weight"})
    stored = StoredWeights(file)
    assert sorted(stored) == ["0.bias", "0.weight", "1.weight", "2.weight"]
    assert stored.key("2.weight") == "1.weight" and torch.equal(stored["2.weight"], weights["1.weight"])
    read = stored.read()
    assert read["2.weight"] is read["1.weight"]  # a tied weight stays one tensor
    with pytest.raises(KeyError):
        stored["3.weight"]


def test_a_checkpoint_that_does_not_fit_is_named(tmp_path):
    file, _, optim = _whole(tmp_path)
    with pytest.raises(ValueError, match="the model has '1.bias', which the checkpoint lacks"):
        load_whole(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]), StoredWeights(file), optim)
    with pytest.raises(ValueError, match="the checkpoint has '1.weight', which the model does not"):
        load_whole(torch.nn.Sequential(torch.nn.Linear(8, 16)), StoredWeights(file), optim)


@pytest.mark.slow
def test_each_fsdp_rank_keeps_its_own_slice_of_a_whole_checkpoint(tmp_path):
    _whole(tmp_path)
    spawn(_load, (2, str(tmp_path)), 2)
