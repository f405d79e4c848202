"""model.qk_norm: an RMSNorm over each head's queries and keys before the rotary embedding. A
dense GPT with it is a Qwen3 weight for weight; it trains the same on FSDP ranks as in one
process (tensor parallelism is refused for now); a mixture of experts with it is refused at
export, naming the option."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.models import GPT, GPTConfig
from kiln.models.family import ExportError
from kiln.models.gpt.hf import hf_adapter

from conftest import tiny_gpt_config, tiny_overrides
from kilnrun import in_process, sets
from layouts import assert_same_training, layout_sets, train_on

transformers = pytest.importorskip("transformers")


def test_the_norms_are_there_and_start_at_one():
    cfg = tiny_gpt_config(qk_norm=True)
    model = GPT(cfg)
    model.init_weights()
    norms = {n: p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(norms) == 4 and all(p.shape == (8,) and torch.equal(p, torch.ones(8)) for p in norms.values())
    plain = GPT(GPTConfig(**{**cfg.__dict__, "qk_norm": False}))
    assert not any("q_norm" in n for n, _ in plain.named_parameters())


def test_a_run_with_qk_norm_exports_as_qwen3_with_the_same_logits(tmp_path, corpus_dir):
    run = tmp_path / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, model__qk_norm="true", train__max_steps=4)))
    in_process("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    from kiln.train.run import load_run

    saved = load_run(run, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, saved.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, saved.model(ids), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def qk_one(tmp_path_factory, corpus_dir):
    """One process with QK-norm: the reference of the layouts below."""
    run = tmp_path_factory.mktemp("qk") / "one"
    in_process("train", *layout_sets(run, corpus_dir, micro=4, model__qk_norm="true"))
    return run


@pytest.mark.parametrize(
    "layout",
    [dict(parallel__strategy="fsdp"), dict(parallel__tp=2), dict(parallel__strategy="fsdp", parallel__dp_replicate=2)],
    ids=["fsdp", "tp-sequence-parallel", "hsdp"],
)
def test_qk_norm_on_two_ranks_trains_as_one_process(tmp_path, corpus_dir, qk_one, layout):
    """Under tensor parallelism each rank norms its own heads; the gains, shared by every head,
    get the sum of every rank's gradient. HSDP: two replicas of two shards (4 ranks)."""
    two = tmp_path / "two"
    micro = 2 if "parallel__strategy" in layout else 4
    nproc = 4 if "parallel__dp_replicate" in layout else 2
    train_on(nproc, layout_sets(two, corpus_dir, micro=micro, model__qk_norm="true", **layout))
    assert_same_training(two, qk_one)


def test_a_mixture_of_experts_with_qk_norm_is_refused_at_export():
    cfg = tiny_gpt_config(qk_norm=True, n_experts=4, experts_per_token=2, d_expert=32)
    with pytest.raises(ExportError, match="model.qk_norm with a mixture of experts"):
        hf_adapter(cfg)
