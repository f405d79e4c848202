"""Exports that never hold the whole model: weights split into files of a bounded size with an
index (as ``transformers`` writes them), and a run saved in shards exported one layer at a time,
by a process whose peak memory stays below the model's size, to files ``transformers`` and PEFT
load with the trained model's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kiln.checkpoint.weights import Entry, Layout, StreamWriter, parse_size, read_weights, write_weights
from kiln.io import INDEX
from kiln.train.run import load_run

from conftest import sft_records, tiny_overrides, write_jsonl
from kilnrun import in_process, launch, peak_rss_of, sets

transformers = pytest.importorskip("transformers")


def test_sizes_are_read_as_transformers_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(1234) == 1234 and parse_size("100") == 100
    for bad in ("five", "5XB", "0", "-1GB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_weights_split_at_the_size_load_back_and_are_indexed(tmp_path):
    shared = torch.randn(64, 16)
    state = {
        "embed.weight": shared,
        "a.weight": torch.randn(100, 10),
        "b.bias": torch.arange(5, dtype=torch.int64),
        "c.weight": torch.randn(30, 30).bfloat16(),
        "head.weight": shared,  # tied: stored once
        "scalar": torch.tensor(3.0),
    }
    writer = write_weights(tmp_path, state, max_shard_size=4500)
    index = json.loads((tmp_path / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert "head.weight" not in index["weight_map"]
    stored = [t for name, t in state.items() if name != "head.weight"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored)
    from safetensors.torch import load_file

    loaded = {k: v for f in files for k, v in load_file(str(tmp_path / f)).items()}
    assert loaded.keys() == state.keys() - {"head.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    assert writer.verify() == len(loaded)
    assert read_weights(tmp_path, {"a.weight"}).keys() == {"a.weight"}

    # Bytes changed on disk are caught; a file the index names that is missing is named.
    target = tmp_path / index["weight_map"]["a.weight"]
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="reads back otherwise"):
        writer.verify()
    target.unlink()
    with pytest.raises(FileNotFoundError, match=f"names {target.name}, which is missing"):
        read_weights(tmp_path)


def test_one_small_file_has_no_index_and_the_writer_keeps_to_its_plan(tmp_path):
    write_weights(tmp_path, {"w": torch.ones(3)}, max_shard_size=10**9)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    writer = StreamWriter(tmp_path / "x", Layout.plan([Entry("w", (3,), torch.float32)], 100))
    (tmp_path / "x").mkdir()
    with pytest.raises(RuntimeError, match="planned"):
        writer.write("w", torch.ones(4))
    with pytest.raises(RuntimeError, match="out of the planned order"):
        writer.write("v", torch.ones(3))


@pytest.mark.slow
@pytest.mark.dist
def test_a_sharded_gpt_larger_than_the_export_process_exports_in_files_transformers_loads(tmp_path, corpus_dir):
    run = tmp_path / "run"
    model = ["model.n_layer=14", "model.d_model=1024", "model.n_head=8", "model.n_kv_head=4", "model.d_ff=4096"]
    items = tiny_overrides(run, corpus_dir, train__max_steps=1, train__micro_batch_size=1, train__global_batch_size=2)
    items += [*model, "parallel.strategy=fsdp", "lora.rank=4", "eval.batches=1", "eval.sample_tokens=0"]
    launch(2, "train", *sets(items), timeout=600)
    checkpoint = run / "checkpoints" / "step-00000001"
    assert (checkpoint / "state").is_dir()
    model_bytes = 4 * sum(torch.Size(shape).numel() for shape, _ in _saved(checkpoint).values())
    assert model_bytes > 0.85e9  # the export's process peaks at about 0.75 GB, its imports half of it

    out = tmp_path / "hf"
    peak, _ = peak_rss_of("export", run, "--format", "hf", "--out", out, "--max-shard-size", "250MB")
    assert peak < model_bytes, f"the export peaked at {peak / 1e9:.2f} GB, the model is {model_bytes / 1e9:.2f} GB"
    info = json.loads((out / "export.json").read_text())
    assert info["check"]["layers"] == [0, 13] and info["hf"]["max_abs_diff"] <= 1e-4
    assert info["hf"]["tensors_verified"] == 14 * 9 + 2  # tied output layer stored once
    index = json.loads((out / INDEX).read_text())
    assert len(set(index["weight_map"].values())) >= 4 and not any("lora" in n for n in index["weight_map"])

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = load_run(run, device="cpu").model(ids)  # gathered whole, with its adapters
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        torch.testing.assert_close(loaded(ids).logits, trained, rtol=0, atol=1e-4)


def _saved(checkpoint: Path):
    from kiln.checkpoint.sharded import ShardedModel

    return ShardedModel(checkpoint).tensors


@pytest.mark.slow
@pytest.mark.dist
def test_a_sharded_lora_fine_tune_of_a_transformers_model_exports_merged_and_as_an_adapter(tmp_path, hf_llama):
    peft = pytest.importorskip("peft")
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(32))
    run = tmp_path / "run"
    items = {
        "run.dir": run,
        "model.source": f"hf:{hf_llama}",
        "data.source": data,
        "data.num_workers": 0,
        "data.seq_len": 64,
        "train.max_steps": 3,
        "train.micro_batch_size": 1,
        "train.global_batch_size": 2,
        "train.lr": 1e-2,
        "eval.every": 0,
        "eval.sample_tokens": 0,
        "lora.rank": 4,
        "parallel.strategy": "fsdp",
    }
    launch(2, "train", *sets([f"{k}={v}" for k, v in items.items()]), timeout=600)
    out = tmp_path / "hf"
    in_process("export", run, "--format", "hf", "--out", out)
    info = json.loads((out / "export.json").read_text())
    assert "streamed" in info and info["hf"]["max_abs_diff"] <= 1e-4

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = load_run(run, device="cpu").model(ids)
        merged = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        torch.testing.assert_close(merged(ids).logits, trained, rtol=0, atol=1e-4)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama, local_files_only=True)
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        torch.testing.assert_close(adapted(ids).logits, trained, rtol=0, atol=1e-4)


def test_a_sharded_checkpoint_that_does_not_fit_the_model_is_refused_by_name(tmp_path, fsdp_run):
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    model_json = json.loads((run / "model.json").read_text())
    model_json["d_ff"] *= 2
    (run / "model.json").write_text(json.dumps(model_json))
    out = tmp_path / "out"
    proc = in_process("export", run, "--format", "hf", "--out", out, check=False)
    assert proc.returncode == 2
    assert "tensor 'blocks.0.mlp.w1.weight' is (128, 64) in the checkpoint, (256, 64) in the model" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
