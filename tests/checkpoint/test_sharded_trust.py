"""A sharded checkpoint (torch.distributed.checkpoint) from elsewhere is read as data: its
metadata and its non-tensor entries are unpickled only as DCP's records, numbers and strings, so
one crafted to run code as it loads is refused with one line and runs nothing."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kiln.checkpoint import CheckpointError, load_sharded
from kiln.checkpoint.sharded import METADATA_FILE

from conftest import Planted


def _saved(tmp_path, state):
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt" / "state"), no_dist=True)
    return tmp_path / "ckpt"


def test_a_sharded_checkpoint_of_tensors_and_settings_loads(tmp_path):
    path = _saved(tmp_path, {"model": {"w": torch.arange(6.0)}, "optimizer": {"lr": 0.1, "betas": (0.9, 0.95)}})
    state = {"model": {"w": torch.zeros(6)}, "optimizer": {"lr": 0.0, "betas": (0.0, 0.0)}}
    load_sharded(path, state)
    assert torch.equal(state["model"]["w"], torch.arange(6.0)) and state["optimizer"] == {
        "lr": 0.1,
        "betas": (0.9, 0.95),
    }


def test_metadata_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    path = _saved(tmp_path, {"model": {"w": torch.ones(3)}})
    marker = tmp_path / "ran"
    (path / "state" / METADATA_FILE).write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointError, match=r"holds a reference to io\.open, which a checkpoint's metadata never"):
        load_sharded(path, {"model": {"w": torch.zeros(3)}})
    assert not marker.exists()


def test_an_entry_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = _saved(tmp_path, {"model": {"w": torch.ones(3)}, "extra": Planted(marker)})
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="ckpt: the sharded checkpoint.s entry extra is not plain data; refused"):
        load_sharded(path, {"model": {"w": torch.zeros(3)}, "extra": None})
    assert not marker.exists()
