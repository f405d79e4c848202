"""LoRA on kiln's own GPT: the adapters are injected into the plain model (its class, plan and
calling convention kept), only they train, exports fold them into the weights, and under bf16
the frozen base is stored in bf16 on every layout."""

import json

import pytest
import torch

from kiln.checkpoint import load_checkpoint
from kiln.cli import main
from kiln.config import load_config
from kiln.models.family import build_model, family_of
from kiln.train.run import load_run

from conftest import tiny_overrides
from kilnrun import in_process, losses
from layouts import assert_same_training, layout_sets, resumable_copy, train_on, weights

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus_dir):
    run = tmp_path_factory.mktemp("lora") / "run"
    sets = tiny_overrides(run, corpus_dir, train__max_steps=8, eval__sample_tokens=0)
    sets += ["lora.rank=4", "lora.alpha=8", "lora.dropout=0", "train.lr=3e-2"]
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
    return run


def test_only_the_adapters_train_on_the_unchanged_base(lora_run):
    run = load_run(lora_run, device="cpu")
    assert type(run.model).__name__ == "GPT"
    cfg = load_config(lora_run / "config.toml", [])
    fresh = build_model(family_of(cfg.model), run.args, "cpu", cfg.train.seed).state_dict()
    trained = run.model.state_dict()
    adapters = [k for k in trained if "lora_" in k]
    assert {k.split(".lora_")[0].split(".")[-1] for k in adapters} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    for name, tensor in trained.items():
        if "lora_" not in name:
            assert torch.equal(tensor, fresh[name.replace(".base_layer", "")]), name
    assert any(trained[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # B starts at zero
    records = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]


def test_exports_fold_the_adapters_into_the_weights(lora_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(lora_run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "export.json").read_text())["hf"]["max_abs_diff"] <= 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    run = load_run(lora_run, device="cpu")
    ids = torch.randint(0, run.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, run.model(ids), rtol=0, atol=1e-5)
    weights = tmp_path / "weights"
    assert main(["export", str(lora_run), "--format", "safetensors", "--out", str(weights)]) == 0
    assert json.loads((weights / "export.json").read_text())["safetensors"]["max_abs_diff"] == 0


def test_qlora_with_tensor_parallelism_is_refused(tmp_path, corpus_dir, capsys):
    sets = tiny_overrides(tmp_path / "run", corpus_dir) + ["lora.rank=4", "lora.quantize_base=nf4", "parallel.tp=2"]
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 2
    assert "lora.quantize_base: nf4 packs" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_an_adapter_on_the_output_layer_is_refused(tmp_path, corpus_dir, capsys):
    """The fused loss reads lm_head's weight itself: an adapter there would never train."""
    sets = tiny_overrides(tmp_path / "run", corpus_dir) + ["lora.rank=4", "lora.target_modules=wq,lm_head"]
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 2
    err = capsys.readouterr().err
    assert "lora.target_modules: the output layer is adapted" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_lora_in_bf16_keeps_a_bf16_base_trains_as_one_process_and_resumes_exactly(tmp_path, corpus_dir):
    """Under bf16 the frozen base is stored in bf16 (half the bytes of fp32 on each FSDP rank)
    and the adapters in fp32, the optimizer's master weights, in one process and on every layout
    alike: both start from the fp32 initial base rounded to bf16 and train alike."""
    lora = dict(lora__rank=4, lora__alpha=8, lora__dropout=0, train__precision="bf16")
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    in_process("train", *layout_sets(one, corpus_dir, micro=4, **lora))
    train_on(2, layout_sets(fsdp, corpus_dir, micro=2, parallel__strategy="fsdp", **lora))
    # Both compute in bf16 from the same weights, but the ranks' gradients are rounded to bf16
    # before they are summed: the losses differ by about 4e-5 here, bf16's precision is 4e-3.
    assert losses(fsdp) == pytest.approx(losses(one), rel=1e-3)
    # HSDP, two replicas of two shards (4 ranks), alike.
    hsdp = tmp_path / "hsdp"
    train_on(4, layout_sets(hsdp, corpus_dir, micro=2, parallel__strategy="fsdp", parallel__dp_replicate=2, **lora))
    assert losses(hsdp) == pytest.approx(losses(one), rel=1e-3)

    def dtype(name: str) -> torch.dtype:
        return torch.float32 if "lora_" in name else torch.bfloat16

    saved, _ = load_checkpoint(one / "checkpoints" / "step-00000006")
    assert saved and {n: t.dtype for n, t in saved.items()} == {n: dtype(n) for n in saved}
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(fsdp / "checkpoints" / "step-00000006" / "state")).read_metadata()
    sharded = {n: meta.state_dict_metadata[f"model.{n}"].properties.dtype for n in saved}
    assert sharded == {n: dtype(n) for n in saved}
    cfg = load_config(one / "config.toml", [])
    run = load_run(one, device="cpu")
    fresh = build_model(family_of(cfg.model), run.args, "cpu", cfg.train.seed).state_dict()
    for name, tensor in weights(fsdp).items():
        if "lora_" not in name:
            initial = fresh[name.replace(".base_layer", "")].to(torch.bfloat16)
            assert torch.equal(tensor, initial.float()) and torch.equal(saved[name], initial), name

    resumed = resumable_copy(fsdp, tmp_path / "resumed", 3)
    proc = train_on(2, layout_sets(resumed, corpus_dir, micro=2, parallel__strategy="fsdp", **lora))
    assert "resumed from" in proc.stdout and losses(resumed) == losses(fsdp)
    for (name, a), b in zip(weights(resumed).items(), weights(fsdp).values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.dist
def test_lora_on_two_tensor_parallel_ranks_trains_as_one_process(tmp_path, corpus_dir):
    """Each adapter splits with its layer (B by columns under a column-split layer, A by rows
    under a row-split one) and its other factor runs whole on each rank's positions (sequence
    parallelism): two tensor-parallel ranks train the adapters as one process does."""
    lora = dict(lora__rank=4, lora__alpha=8, lora__dropout=0, train__lr=3e-2)
    one, tp = tmp_path / "one", tmp_path / "tp"
    in_process("train", *layout_sets(one, corpus_dir, micro=4, **lora))
    train_on(2, layout_sets(tp, corpus_dir, micro=4, parallel__strategy="ddp", parallel__tp=2, **lora))
    assert_same_training(tp, one)
    assert any("lora_B" in name for name in weights(tp))
