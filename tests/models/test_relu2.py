"""model.mlp = "relu2": the dense blocks' MLP is w2(relu(w1 x)^2), two matrices. Counted as such
by the parameter count, the FLOPs and the memory model; split over tensor-parallel ranks like
SwiGLU less its w3 (two ranks train as one process); exported to Hugging Face as an Arcee with the
same logits (with QK-norm refused, naming it)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ConfigError, ModelConfig
from kiln.models import GPT, build_gpt_config
from kiln.models.family import ExportError, MemoryContext
from kiln.models.gpt import FAMILY, flops_per_token
from kiln.models.gpt.hf import hf_adapter
from kiln.models.gpt.memory import GPTMemory
from kiln.models.gpt.presets import param_count

from conftest import tiny_gpt_config, tiny_overrides
from kilnrun import in_process, sets
from layouts import assert_same_training, layout_sets, train_on


def test_the_mlp_squares_a_relu_with_two_matrices():
    cfg = tiny_gpt_config(mlp="relu2")
    model = GPT(cfg)
    mlp = model.blocks[0].mlp
    assert mlp.w3 is None and not any(".w3." in n for n, _ in model.named_parameters())
    x = torch.randn(2, 5, cfg.d_model)
    torch.testing.assert_close(mlp(x), F.relu(x @ mlp.w1.weight.T) ** 2 @ mlp.w2.weight.T)
    assert param_count(cfg) == model.num_params()
    swiglu = tiny_gpt_config()
    assert param_count(swiglu) - param_count(cfg) == cfg.n_layer * cfg.d_model * cfg.d_ff
    fewer = flops_per_token(swiglu, 64) - flops_per_token(cfg, 64)
    assert fewer == 6 * cfg.n_layer * cfg.d_model * cfg.d_ff


def test_the_key_resolves_and_a_bad_value_is_named():
    assert build_gpt_config(ModelConfig(preset="tiny", mlp="relu2"), 256, 64).mlp == "relu2"
    assert build_gpt_config(ModelConfig(preset="tiny"), 256, 64).mlp == "swiglu"
    with pytest.raises(ConfigError, match="model.mlp: 'gelu' is not one of swiglu, relu2, preset"):
        build_gpt_config(ModelConfig(preset="tiny", mlp="gelu"), 256, 64)


def test_the_memory_model_counts_what_autograd_saves():
    """The MLP's saved tensors, measured with saved-tensor hooks, differ between the two kinds by
    what the memory model says they do."""
    saved = {}
    for kind in ("swiglu", "relu2"):
        cfg = tiny_gpt_config(mlp=kind)
        mlp = GPT(cfg).blocks[0].mlp
        x = torch.randn(4, 16, cfg.d_model, requires_grad=True)
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(x)
        params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
        saved[kind] = sum(
            n for ptr, n in storages.items() if ptr not in params and ptr != x.untyped_storage().data_ptr()
        )
    ctx = MemoryContext(tokens=64, autocast=False, residual_bytes=4, tp=1, casts_weights=False)
    modelled = {kind: GPTMemory(tiny_gpt_config(mlp=kind))._mlp(ctx) * 64 for kind in saved}
    assert saved["swiglu"] - saved["relu2"] == modelled["swiglu"] - modelled["relu2"]


def test_a_relu2_run_exports_as_arcee_with_the_same_logits_and_loads_back(tmp_path, corpus_dir):
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    overrides = tiny_overrides(run, corpus_dir, model__mlp="relu2", model__tie_embeddings="false", train__max_steps=4)
    in_process("train", *sets(overrides))
    in_process("export", run, "--format", "hf", "--out", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["hidden_act"]) == (["ArceeForCausalLM"], "relu2")
    from kiln.train.run import load_run

    saved = load_run(run, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not any("gate_proj" in n for n, _ in hf.named_parameters())
    ids = torch.randint(0, saved.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, saved.model(ids), rtol=0, atol=1e-5)
    adapter = hf_adapter(saved.args)
    back = adapter.from_hf(adapter.to_hf(saved.model.state_dict()))
    assert back.keys() == saved.model.state_dict().keys()


def test_relu2_with_qk_norm_is_refused_at_export_naming_both():
    with pytest.raises(ExportError, match="model.mlp=relu2 with model.qk_norm"):
        hf_adapter(tiny_gpt_config(mlp="relu2", qk_norm=True))


def test_tensor_parallel_plan_has_no_w3():
    from kiln.models.gpt.model import Block

    config = tiny_gpt_config(mlp="relu2")
    styles = FAMILY.parallel_plan(config).tensor_parallel(Block(config))
    assert "mlp.w3" not in styles and {"mlp.w1", "mlp.w2"} <= styles.keys()
    assert FAMILY.lora_targets(tiny_gpt_config(mlp="relu2")) == ["wq", "wk", "wv", "wo", "w1", "w2"]


@pytest.mark.slow
def test_relu2_on_two_tensor_parallel_ranks_trains_as_one_process(tmp_path, corpus_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    in_process("train", *layout_sets(one, corpus_dir, micro=4, model__mlp="relu2"))
    train_on(2, layout_sets(two, corpus_dir, micro=4, model__mlp="relu2", parallel__tp=2))
    assert_same_training(two, one)
