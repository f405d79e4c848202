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

from conftest import Planted, tiny_overrides
from kilnrun import in_process, sets


def _state():
    w = torch.randn(4, 3)
    return {"emb.weight": w, "head.weight": w, "bias": torch.zeros(3)}


def test_round_trip_keeps_tied_tensors(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 7, state, {"step": 7, "x": [1, 2]})
    assert path.name == "step-00000007"
    model_state, train_state = load_checkpoint(path, with_state=True)
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
    # A writer killed between the two renames of a re-saved step left the old copy aside.
    (tmp_path / ".old-step-00000002-999").mkdir()
    # the next save cleans up the dead writers' leftovers
    save_checkpoint(tmp_path, 6, _state(), {})
    assert not (tmp_path / ".tmp-step-00000003-999").exists() and not (tmp_path / ".old-step-00000002-999").exists()


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


def _plant(checkpoint, state):
    """Replace a checkpoint's train_state.pt by ``state`` and its manifest's entry to match, as
    someone handing over a run directory could."""
    torch.save(state, checkpoint / "train_state.pt")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / "train_state.pt").read_bytes()
    import hashlib

    manifest["files"]["train_state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_training_state_that_would_run_code_is_refused_and_nothing_runs(tmp_path, corpus_dir):
    run = tmp_path / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=4)))
    checkpoint = latest_checkpoint(run / "checkpoints")
    marker = tmp_path / "ran"
    _plant(checkpoint, {"step": 4, "rng": Planted(marker)})

    with pytest.raises(CheckpointError, match="holds a reference to io.open, which kiln never writes"):
        load_checkpoint(checkpoint, with_state=True)
    proc = in_process("train", "--resume", checkpoint, *sets(tiny_overrides(run, corpus_dir)), check=False)
    assert proc.returncode == 2 and not marker.exists()
    [line] = [line for line in proc.stderr.splitlines() if "error" in line]
    assert (
        line.startswith("kiln: error: ")
        and str(checkpoint / "train_state.pt") in line
        and "refused, since loading it could run code" in line
    )


def test_the_rng_state_is_saved_as_plain_data_and_older_numpy_arrays_still_load(tmp_path):
    state = capture_rng()
    assert isinstance(state["numpy"][1], list)
    old = {**state, "numpy": np.random.get_state()}  # as kiln saved it before (an ndarray of keys)
    path = save_checkpoint(tmp_path, 1, _state(), {"rng": old})
    a = np.random.rand()
    restore_rng(load_checkpoint(path, with_state=True)[1]["rng"])
    assert np.random.rand() == a
