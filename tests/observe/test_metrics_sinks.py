"""The logger's optional sinks: weight/gradient histograms read back with TensorBoard's own
reader, and Weights & Biases in offline mode (no network) read back from its run file."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing import event_accumulator as ea

from kiln.config import ConfigError
from kiln.observe import MetricsLogger, NullLogger
from kiln.observe.metrics import WANDB_ID_FILE

from kilnrun import spawn


def _histograms(run_dir: Path) -> dict[str, list]:
    acc = ea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={ea.HISTOGRAMS: 0})
    acc.Reload()
    return {tag: acc.Histograms(tag) for tag in acc.Tags()["histograms"]}


def _model_with_grads() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model(torch.randn(5, 4)).square().mean().backward()
    return model


def test_histograms_readable_by_tensorboard(tmp_path):
    model = _model_with_grads()
    model[1].bias.grad = None  # e.g. a frozen parameter: weights only
    model[1].weight.grad[0, 0] = math.nan  # non-finite values are left out, not fatal
    with MetricsLogger(tmp_path, total_steps=10, console=False) as logger:
        logger.histograms(3, model)
        logger.histograms(6, model)
    hists = _histograms(tmp_path)

    names = [name for name, _ in model.named_parameters()]
    assert set(hists) == {f"weights/{n}" for n in names} | {f"grads/{n}" for n in names if n != "1.bias"}
    assert [e.step for e in hists["weights/0.weight"]] == [3, 6]
    weight = hists["weights/0.weight"][0].histogram_value
    assert weight.num == 32
    assert weight.min == pytest.approx(model[0].weight.min().item())
    assert weight.max == pytest.approx(model[0].weight.max().item())
    assert weight.sum == pytest.approx(model[0].weight.sum().item(), abs=1e-5)
    assert sum(weight.bucket) == 32
    grad = hists["grads/0.weight"][0].histogram_value
    assert grad.sum == pytest.approx(model[0].weight.grad.sum().item(), abs=1e-6)
    assert hists["grads/1.weight"][0].histogram_value.num == 15


def test_expert_load_becomes_one_scalar_per_layer_and_expert(tmp_path):
    load = {"blocks.1.mlp": [0.5, 0.25, 0.25, 0.0], "blocks.2.mlp": [0.1, math.nan, 0.6, 0.3]}
    with MetricsLogger(tmp_path, total_steps=10, console=False) as logger:
        logger.log(5, {"loss": 3.0, "moe/imbalance": 2.0, "moe/load": load})
        logger.log(10, {"loss": 2.5, "moe/load": {"blocks.1.mlp": [0.25] * 4}})
    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    per_expert = {f"moe/load/blocks.{layer}.mlp/{i}" for layer in (1, 2) for i in range(4)}
    assert set(scalars) == {"loss", "moe/imbalance"} | per_expert - {"moe/load/blocks.2.mlp/1"}  # NaN left out
    assert scalars["moe/load/blocks.1.mlp/0"] == [(5, 0.5), (10, 0.25)]
    assert scalars["moe/load/blocks.2.mlp/2"] == [(5, pytest.approx(0.6))]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["moe/load"]["blocks.1.mlp"] == load["blocks.1.mlp"]  # metrics.jsonl keeps the dict


def test_null_logger_histograms_is_a_no_op():
    with NullLogger() as logger:
        logger.histograms(1, _model_with_grads())


def _sharded_histograms(rank: int, world: int, init_file: str, run_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = torch.nn.Linear(4, 8, bias=False)
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        model.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        model.weight.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        # Rank 0 logs, the others hold a NullLogger: nothing here may wait on them.
        logger = MetricsLogger(run_dir, total_steps=1, console=False) if rank == 0 else NullLogger()
        with logger:
            logger.histograms(1, model)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_histograms_of_sharded_parameters_show_the_local_shard(tmp_path):
    (tmp_path / "run").mkdir()
    spawn(_sharded_histograms, (2, str(tmp_path / "init"), str(tmp_path / "run")), 2)
    weight = _histograms(tmp_path / "run")["weights/weight"][0].histogram_value
    # Rank 0 holds rows 0-3 of the (8, 4) weight: the values 0..15.
    assert (weight.num, weight.min, weight.max, weight.sum) == (16, 0, 15, sum(range(16)))
    assert _histograms(tmp_path / "run")["grads/weight"][0].histogram_value.num == 16


# -- Weights & Biases, offline ----------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (``run-ID.wandb``): a LevelDB-style log of 32 KiB
    blocks after a 7-byte header, each record chunk prefixed by crc32 (4 bytes), length
    (2, little-endian) and type (1: full, 2: first, 3: middle, 4: last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):  # still being written
            return
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wait_until_complete(run_file: Path, timeout: float = 60) -> None:
    """W&B's service process writes the run file after ``finish()`` returns: wait for the
    ``exit`` record, the last one of a finished run."""
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_file)):
        assert time.monotonic() < deadline, f"{run_file}: no exit record after {timeout}s"
        time.sleep(0.2)


def _wandb_history(run_file: Path) -> dict[int, dict]:
    """History rows by step, nested keys joined with "/" ("sample/_type"), values decoded."""
    _wait_until_complete(run_file)
    rows: dict[int, dict] = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        rows.setdefault(row["_step"], {}).update(row)
    return rows


def _wandb_config(run_file: Path) -> dict:
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "run":
            return {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return {}


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # W&B's settings and cache stay inside the test, not in the user's home.
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def _run_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def test_wandb_offline_logs_every_record(tmp_path, wandb_offline):
    run = tmp_path / "run"
    run.mkdir()
    with MetricsLogger(
        run, total_steps=4, console=False, wandb_project="kiln-test", config={"train": {"lr": 0.003}}
    ) as logger:
        logger.log(1, {"loss": 5.0, "lr": 1e-3, "memory/rss_gib": 0.5})
        logger.log(2, {"loss": math.nan, "lr": 2e-3})
        logger.log(2, {"val_loss": 4.5, "val_bpb": 1.9})
        logger.event(3, "out_of_memory", "retrying the step with micro-batch 2")
        logger.text(3, "sample", "def f(x):\n    return x < 1")
        logger.histograms(4, _model_with_grads())
        logger.log(4, {"loss": 4.0, "lr": 3e-3})

    run_id = (run / WANDB_ID_FILE).read_text().strip()
    [run_file] = _run_files(run)
    assert run_file.name == f"run-{run_id}.wandb"
    history = _wandb_history(run_file)
    assert history[1]["loss"] == 5.0 and history[1]["memory/rss_gib"] == 0.5
    assert history[2]["lr"] == 2e-3 and history[2]["val_loss"] == 4.5 and history[2]["val_bpb"] == 1.9
    assert math.isnan(float(history[2]["loss"]))
    assert history[3]["events/out_of_memory"] == "retrying the step with micro-batch 2"
    assert history[3]["sample/_type"] == "html-file"
    assert history[4]["weights/0.weight/_type"] == "histogram" and history[4]["grads/1.bias/_type"] == "histogram"
    assert sum(history[4]["weights/0.weight/values"]) == 32
    assert history[4]["loss"] == 4.0
    assert _wandb_config(run_file)["train"] == {"lr": 0.003}


def test_wandb_resumed_run_continues_the_same_run(tmp_path, wandb_offline):
    run = tmp_path / "run"
    run.mkdir()
    with MetricsLogger(run, total_steps=4, console=False, wandb_project="kiln-test") as logger:
        logger.log(1, {"loss": 5.0})
    with MetricsLogger(run, total_steps=4, start_step=1, console=False, wandb_project="kiln-test") as logger:
        logger.log(2, {"loss": 4.0})
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    files = _run_files(run)
    # Offline, each process writes its own run file; both carry the one id, which `wandb sync`
    # uploads as one run.
    assert len(files) == 2 and {f.name for f in files} == {f"run-{run_id}.wandb"}
    assert [sorted(_wandb_history(f)) for f in files] in ([[1], [2]], [[2], [1]])


def test_wandb_missing_names_the_key_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError) as info:
        MetricsLogger(tmp_path, total_steps=1, console=False, tensorboard=False, wandb_project="p")
    assert "observe.wandb" in str(info.value) and "pip install wandb" in str(info.value)


def test_training_writes_histograms_every_n_steps(tmp_path):
    from conftest import token_sequences, train_tiny_gpt

    train_tiny_gpt(
        tmp_path / "run", token_sequences(tmp_path), micro=4, global_=8, steps=6, **{"observe.histograms_every": 3}
    )
    hist = _histograms(tmp_path / "run")
    assert "weights/blocks.0.attn.wq.weight" in hist and "grads/blocks.0.attn.wq.weight" in hist
    assert [e.step for e in hist["grads/blocks.0.attn.wq.weight"]] == [3, 6]
