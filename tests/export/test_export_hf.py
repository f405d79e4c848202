"""kiln export --format hf: transformers loads the directory with its own classes and computes
kiln's logits and greedy tokens (tied, untied and grouped-query variants); kiln trains the export
on from the same weights; the export is written whole or not at all."""

import json

import pytest
import torch

from kiln.cli import main
from kiln.train.run import load_run

from conftest import tiny_overrides

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")


VARIANTS = {
    "tied-gqa": ["model.tie_embeddings=true", "model.n_kv_head=2"],
    "untied-gqa": ["model.tie_embeddings=false", "model.n_kv_head=2"],
    "tied-mha": ["model.tie_embeddings=true", "model.n_kv_head=4"],
}


def train(tmp_path_factory, corpus_dir, variant):
    run = tmp_path_factory.mktemp(variant) / "run"
    sets = tiny_overrides(run, corpus_dir, train__max_steps=4, eval__sample_tokens=0) + VARIANTS[variant]
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
    return run


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_run(request, tmp_path_factory, corpus_dir):
    return train(tmp_path_factory, corpus_dir, request.param)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_dir):
    return train(tmp_path_factory, corpus_dir, "tied-gqa")


def test_kilns_gpt_exports_as_a_llama_transformers_loads(variant_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(variant_run), "--format", "hf", "--out", str(out)]) == 0
    info = json.loads((out / "export.json").read_text())
    assert info["step"] == 4 and {"config.json", "model.safetensors", "tokenizer.json"} <= set(info["files"])
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    run = load_run(variant_run, device="cpu")
    text = "def parse(text):\n    return text.split()"
    ids = torch.tensor([tok(text)["input_ids"]])
    assert ids[0].tolist() == run.tokenizer.encode(text).ids  # the same tokenizer
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, run.model(ids), rtol=0, atol=1e-4)
    assert info["hf"]["max_abs_diff"] <= 1e-4  # on the run's own validation tokens
    tied = run.args.tie_embeddings
    assert model.config.tie_word_embeddings == tied and model.config.num_key_value_heads == run.args.n_kv_head
    if tied:  # stored once
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:
            assert "lm_head.weight" not in set(f.keys())

    # Greedy decoding in transformers picks kiln's tokens (to the end of the context).
    prompt = ids[:, :8]
    new = run.args.max_seq_len - prompt.size(1)
    theirs = model.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs, run.family.generate(run.model, prompt, new, temperature=0))


def test_kiln_trains_on_from_the_export_with_the_runs_weights(gpt_run, corpus_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(out)]) == 0
    # At a learning rate far below fp32 resolution the weights stay the exported ones: the run
    # validates exactly as the original does.
    again = tmp_path / "again"
    sets = tiny_overrides(again, corpus_dir, train__max_steps=2, train__lr=1e-12, eval__sample_tokens=0)
    sets += [f"model.source=hf:{out}", "eval.every=2"]
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
    capsys.readouterr()
    assert main(["eval", str(gpt_run), "--max-batches", "2"]) == 0
    original = json.loads(capsys.readouterr().out)
    logged = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in logged if "val_loss" in r] == [original["val_loss"]]


def test_an_existing_output_is_kept_unless_forced_over_an_export_and_never_over_the_source(gpt_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    # --force replaces a kiln export only: not a directory of other files,
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(out), "--force"]) == 2
    assert "--force replaces only a kiln export (a directory with export.json)" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    # nor the run being exported or a directory that holds it.
    for source_or_parent in (gpt_run, gpt_run.parent):
        before = sorted(p.relative_to(gpt_run) for p in gpt_run.rglob("*"))
        assert main(["export", str(gpt_run), "--format", "hf", "--out", str(source_or_parent), "--force"]) == 2
        assert "--force never replaces the source" in capsys.readouterr().err
        assert sorted(p.relative_to(gpt_run) for p in gpt_run.rglob("*")) == before
    exported = tmp_path / "exported"
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(exported)]) == 0
    (exported / "extra.txt").write_text("old")
    assert main(["export", str(gpt_run), "--format", "safetensors", "--out", str(exported), "--force"]) == 0
    assert not (exported / "extra.txt").exists() and (exported / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".exported.*"))  # no staging directory left behind


def test_a_missing_run_is_an_error_and_writes_nothing(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    assert "not a kiln run directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model_type, save",
    [
        ("bert", dict(headless=True)),  # an encoder's base model save, fine-tuned as a classifier
        ("llama", dict(headless=True, shards=True, dtype=torch.bfloat16, tie_word_embeddings=True)),
        ("qwen3", dict()),
    ],
    ids=["bert-headless", "llama-headless-sharded-bf16", "qwen3-headed"],
)
def test_a_fine_tune_exports_every_tensor_of_its_source_directory(tmp_path, model_type, save):
    """One step at a learning rate far below fp32 resolution, exported: the export holds every
    tensor the source directory stored (under the name transformers gives it in the model with a
    head: a base model's save gains its prefix), with its values."""
    from safetensors.torch import load_file

    from kiln.io import weight_files

    from conftest import ft_sets, sft_records, write_jsonl
    from hf_models import learnable_classes, save_tiny, task_of

    source = save_tiny(tmp_path / "model", model_type, tokenizer=True, **save)
    task = task_of(model_type)
    records = learnable_classes(32) if task == "sequence_classification" else sft_records(32)
    data = write_jsonl(tmp_path / "records.jsonl", records)
    run, out = tmp_path / "run", tmp_path / "hf"
    sets = ft_sets(run, data, source, model__task=task, train__max_steps=1, train__lr=1e-12, train__warmup_steps=0)
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0

    def tensors(directory):
        return {k: v for file in weight_files(directory) for k, v in load_file(directory / file).items()}

    stored, exported = tensors(source), tensors(out)
    prefix = transformers.AutoConfig.from_pretrained(out).architectures[0]
    prefix = getattr(transformers, prefix).base_model_prefix
    for name, value in stored.items():
        got = exported.get(name, exported.get(f"{prefix}.{name}"))
        assert got is not None, f"{name} is not in the export"
        torch.testing.assert_close(got.float(), value.float(), rtol=1e-5, atol=1e-8, msg=name)
    assert len(stored) > 10
