"""The family interface, through kiln's GPT: built on meta and materialised, it is the eager
model; its plan says how it splits; its Hugging Face names load into transformers' Llama."""

import pytest
import torch

from kiln.cli import main
from kiln.config import ConfigError, ModelConfig
from kiln.models import GPT, GPTConfig, ParallelPlan, build_model, get_family
from kiln.models.gpt import FAMILY
from kiln.plan.estimate import tp_split_dim

DIMS = dict(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=16)


@pytest.mark.parametrize("tie", [True, False])
def test_meta_build_then_materialize_equals_eager_construction(tie):
    cfg = GPTConfig(**DIMS, tie_embeddings=tie)
    eager = GPT(cfg)
    eager.init_weights(seed=7)
    built = build_model(FAMILY, cfg, "cpu", seed=7)
    assert list(eager.state_dict()) == list(built.state_dict())
    for (name, a), b in zip(eager.state_dict().items(), built.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert (built.lm_head.weight is built.tok_emb.weight) == tie
    for name in ("rope_cos", "rope_sin"):  # derived buffers are filled too
        assert torch.equal(getattr(eager, name), getattr(built, name))


def test_a_tensor_starts_from_the_seed_and_its_name_alone():
    """What lets a rank initialise its shard of one parameter without the rest of the model: a
    deeper model's first layers start exactly as the shallower one's, and another seed differs."""
    shallow = build_model(FAMILY, GPTConfig(**DIMS, tie_embeddings=True), "cpu", seed=7).state_dict()
    deeper = build_model(FAMILY, GPTConfig(**{**DIMS, "n_layer": 3}, tie_embeddings=True), "cpu", seed=7)
    other = build_model(FAMILY, GPTConfig(**DIMS, tie_embeddings=True), "cpu", seed=8).state_dict()
    for name, value in shallow.items():
        if not name.endswith(("wo.weight", "w2.weight")):  # their scale depends on the depth
            assert torch.equal(deeper.state_dict()[name], value), name
    assert not torch.equal(other["blocks.0.attn.wq.weight"], shallow["blocks.0.attn.wq.weight"])
    # A model constructed directly draws from PyTorch's generator: reproducible under manual_seed.
    torch.manual_seed(3)
    a = GPT(GPTConfig(**DIMS, tie_embeddings=True))
    torch.manual_seed(3)
    assert torch.equal(GPT(GPTConfig(**DIMS, tie_embeddings=True)).blocks[1].mlp.w1.weight, a.blocks[1].mlp.w1.weight)


def test_gpt_plan_names_its_layers_and_tp_splits():
    plan = FAMILY.parallel_plan(GPTConfig(**DIMS, tie_embeddings=True))
    model = build_model(FAMILY, GPTConfig(**DIMS, tie_embeddings=True), "cpu", 0)
    assert plan.repeated_blocks(model) == list(model.blocks)
    block, names = model.blocks[0], ("attn.wq.weight", "attn.wo.weight", "mlp.w1.weight", "mlp.w2.weight")
    assert [tp_split_dim(plan, block, n) for n in (*names, "attn_norm.weight")] == [0, 1, 0, 1, None]
    assert plan.tp_root is not None and {"tok_emb", "norm", "lm_head"} <= plan.tp_root(model).keys()
    assert plan.loss == "head_loss" and plan.sequence_parallel
    plan.check_tensor_parallel(2, "gpt")
    with pytest.raises(ConfigError, match=r"parallel.tp: 4 must divide model.n_kv_head=2"):
        plan.check_tensor_parallel(4, "gpt")


def test_a_model_without_a_plan_cannot_be_split():
    plan = ParallelPlan.infer(torch.nn.Linear(2, 2))
    assert plan.blocks is None and plan.repeated_blocks(torch.nn.Linear(2, 2)) == []
    with pytest.raises(ConfigError, match="parallel.tp: tensor parallelism needs a model family's plan"):
        plan.check_tensor_parallel(2, "Linear")


@pytest.mark.parametrize(
    "name, message",
    [
        ("transformer", "model.family: 'transformer' is not one of gpt"),
        ("no_such_module:FAMILY", "model.family: cannot load 'no_such_module:FAMILY'"),
        ("kiln.models.gpt:GPT", "not a kiln.models.ModelFamily"),
    ],
)
def test_unknown_family_is_a_config_error(name, message):
    with pytest.raises(ConfigError, match=message):
        get_family(name)


def test_model_keys_are_checked_by_the_family_before_anything_runs(tmp_path, capsys):
    assert main(["config", "--set", "model.preset=huge"]) == 2
    assert "model.preset: 'huge' is not one of tiny, small" in capsys.readouterr().err
    assert main(["train", "--set", f"run.dir={tmp_path / 'run'}", "--set", "model.n_head=5"]) == 2
    assert "model.n_head: 5 does not divide model.d_model 128" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert FAMILY.resolve(ModelConfig(preset="small"), vocab_size=100, seq_len=64).d_model == 256


@pytest.mark.parametrize(
    "dims",
    [
        dict(tie_embeddings=True),
        dict(tie_embeddings=False),
        dict(tie_embeddings=True, n_kv_head=1, rope_theta=500.0),  # grouped-query attention, another RoPE base
    ],
)
def test_llama_names_load_into_transformers_with_the_same_logits(dims):
    transformers = pytest.importorskip("transformers")
    cfg = GPTConfig(**{**DIMS, **dims})
    model = build_model(FAMILY, cfg, "cpu", seed=3).eval()
    adapter = FAMILY.state_dict_adapter(cfg)
    hf_state = adapter.to_hf(model.state_dict())
    assert ("lm_head.weight" in hf_state) != cfg.tie_embeddings  # a tied matrix is stored once
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**adapter.hf_config())).eval()
    missing, unexpected = llama.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    llama.tie_weights()
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(llama(idx).logits, model(idx), rtol=0, atol=1e-5)
    back = adapter.from_hf(hf_state)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
