"""A Hugging Face checkpoint read tensor by tensor into a model built without storage: the same
weights as ``from_pretrained``, and bad files stopped in one line before anything is written."""

import dataclasses
import json
import shutil

import pytest
import torch

from kiln.cli import main
from kiln.config import ModelConfig
from kiln.models.hf import FAMILY
from kiln.models.init import allocate, params_on_meta

from conftest import sft_records, write_jsonl

pytest.importorskip("transformers")


def _args(directory, task="causal_lm"):
    return FAMILY.resolve(ModelConfig(source=f"hf:{directory}", task=task), vocab_size=0, seq_len=64)


def _read(args, seed=0):
    """The model as a run starts it: built with its parameters on meta, then filled by name."""
    with params_on_meta():
        model = FAMILY.build(args)
    assert all(p.is_meta for p in model.parameters())
    values = FAMILY.initial_values(args, model, seed)
    assert values is not None
    allocate(model, "cpu")
    values.fill(model)
    return model, values


def test_read_by_name_is_what_from_pretrained_loads(hf_llama):
    """hf_llama is saved in several files with an index."""
    args = _args(hf_llama)
    model, values = _read(args)
    reference = FAMILY.create(args, "cpu", seed=0)
    assert values.new == [] and values.missing == []
    want = dict(reference.state_dict()) | dict(reference.named_buffers())
    got = dict(model.state_dict()) | dict(model.named_buffers())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("make", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_experts_stored_one_by_one_are_read_into_the_fused_tensors_from_pretrained_makes(tmp_path, make):
    """transformers saves a mixture of experts one expert at a time (Qwen3-MoE's gate_proj/up_proj/
    down_proj, Mixtral's w1/w3/w2 under block_sparse_moe) and computes with them fused."""
    import hf_models

    args = _args(getattr(hf_models, make)(tmp_path / make, experts=4))
    model, values = _read(args)
    fused = [key for key, source in values.sources.items() if not isinstance(source, str)]
    assert values.missing == [] and len(fused) == 2 * args.config["num_hidden_layers"]
    want = FAMILY.create(args, "cpu", seed=0).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_classifiers_new_head_starts_from_the_seed_and_its_name(hf_bert):
    # Three labels where the directory's head has two: the head is new.
    args = dataclasses.replace(_args(hf_bert, "sequence_classification"), labels=("a", "b", "c"))
    model, values = _read(args, seed=3)
    again, _ = _read(args, seed=3)
    other, _ = _read(args, seed=4)
    reference = FAMILY.create(args, "cpu", seed=0).state_dict()
    state = model.state_dict()
    assert values.new == ["classifier.bias", "classifier.weight"]
    for name, value in state.items():
        key = name.removeprefix("hf.")
        if key == "classifier.weight":
            assert 0 < value.std() < 0.1 and torch.equal(value, again.state_dict()[name]), name
            assert not torch.equal(value, other.state_dict()[name]), name
        elif key == "classifier.bias":
            assert torch.equal(value, torch.zeros(3))
        else:
            assert torch.equal(value, reference[name]), name


@pytest.fixture
def sft(tmp_path):
    return write_jsonl(tmp_path / "sft.jsonl", sft_records(16))


def _train(tmp_path, model_dir, sft, capsys) -> str:
    run = tmp_path / "run"
    sets = {
        "run.dir": run,
        "model.source": f"hf:{model_dir}",
        "data.source": sft,
        "data.seq_len": 64,
        "data.num_workers": 0,
        "train.max_steps": 1,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2,
        "eval.every": 0,
    }
    assert main(["train", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]) == 2
    assert not (run / "checkpoints").exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _copy(hf_llama, tmp_path):
    return shutil.copytree(hf_llama, tmp_path / "model")


def test_an_index_naming_a_missing_file_is_one_line(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    gone = sorted(model.glob("model-*.safetensors"))[1]
    gone.unlink()
    err = _train(tmp_path, model, sft, capsys)
    assert "model.safetensors.index.json" in err and gone.name in err


def test_a_truncated_file_is_one_line_naming_it(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    cut = sorted(model.glob("model-*.safetensors"))[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    err = _train(tmp_path, model, sft, capsys)
    assert cut.name in err


def test_shapes_that_do_not_match_the_config_are_one_line_naming_the_tensor(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    err = _train(tmp_path, model, sft, capsys)
    assert "model.source:" in err and "mlp.down_proj.weight has shape [64, 128]" in err and "[64, 96]" in err, err
