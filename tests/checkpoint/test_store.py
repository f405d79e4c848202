import json
import random

import numpy as np
import pytest
import torch

from kiln.checkpoint import (
    CheckpointError,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)


def _state():
    w = torch.randn(4, 3)
    return {"emb.weight": w, "head.weight": w, "bias": torch.zeros(3)}


def test_round_trip_keeps_tied_tensors(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 7, state, {"step": 7, "x": [1, 2]})
    assert path.name == "step-00000007"
    model_state, train_state = load_checkpoint(path, weights_only=False)
    assert train_state == {"step": 7, "x": [1, 2]}
    assert torch.equal(model_state["emb.weight"], state["emb.weight"])
    assert torch.equal(model_state["head.weight"], state["head.weight"])


def test_keep_last_k_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _state(), {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path).name == "step-00000004"


def test_partial_checkpoints_are_ignored(tmp_path):
    save_checkpoint(tmp_path, 1, _state(), {})
    good = save_checkpoint(tmp_path, 2, _state(), {})
    # A writer killed before its rename leaves a temporary dir; one killed after a crash that
    # lost data leaves files that do not match the manifest; one with no manifest is unfinished.
    (tmp_path / ".tmp-step-00000003-999").mkdir()
    no_manifest = tmp_path / "step-00000004"
    no_manifest.mkdir()
    (no_manifest / "model.safetensors").write_bytes(b"xx")
    truncated = tmp_path / "step-00000005"
    truncated.mkdir()
    for f in good.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes())
    with open(truncated / "train_state.pt", "r+b") as f:
        f.truncate(10)
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="incomplete or corrupted"):
        load_checkpoint(truncated)
    # the next save cleans up the dead writer's temporary dir
    save_checkpoint(tmp_path, 6, _state(), {})
    assert not (tmp_path / ".tmp-step-00000003-999").exists()


def test_corrupted_bytes_detected_by_digest(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state(), {})
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_manifest_lists_files(tmp_path):
    path = save_checkpoint(tmp_path, 3, _state(), {"a": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {"model.safetensors", "train_state.pt"}


def test_rng_round_trip():
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
