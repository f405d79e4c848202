"""Fine-tuning Hugging Face mixtures of experts (tiny Qwen3-MoE and Mixtral made here): LoRA on
attention and on the fused experts, the routers' load in the metrics, FLOPs of the experts a
token goes through, FSDP over two ranks equal to one process, and the export in transformers
and peft."""

import math
from pathlib import Path

import pytest
import torch
from test_finetune import assert_trains_as
from test_finetune import ft_sets as finetune_sets

from kiln.cli import main
from kiln.config import ConfigError, load_config
from kiln.models.hf import FAMILY
from kiln.train.apply import apply_lora
from kiln.train.run import load_run

from conftest import sft_records, write_jsonl
from hf_models import tiny_mixtral, tiny_qwen3_moe
from kilnrun import in_process, launch, losses, records, sets

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.e2e

EXPERTS = 4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = {"lora.rank": 8, "lora.dropout": 0, "lora.target_modules": ",".join([*ATTENTION, "gate_up_proj", "down_proj"])}


def ft_sets(run_dir: Path, source: Path, model_dir: Path, **extra) -> list[str]:
    """test_finetune's fine-tune, shorter and at a higher learning rate."""
    faster = {"train.max_steps": 6, "train.lr": 1e-2, "train.warmup_steps": 1, "checkpoint.every": 6}
    return finetune_sets(run_dir, source, model_dir, **{**faster, **extra})


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("sft") / "sft.jsonl", sft_records(96))


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"), experts=EXPERTS)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, sft, qwen_moe) -> Path:
    """One process: LoRA on attention and on the experts."""
    run = tmp_path_factory.mktemp("lora") / "run"
    in_process("train", *sets(ft_sets(run, sft, qwen_moe, **LORA)))
    return run


def _args(model_dir: Path, *items: str):
    cfg = load_config(None, [f"model.source=hf:{model_dir}", *items])
    return cfg, FAMILY.resolve(cfg.model, vocab_size=0, seq_len=64)


def test_lora_fine_tune_learns_and_logs_the_routers_load(lora_run):
    loss = losses(lora_run)
    assert loss[max(loss)] < loss[1] - 0.1
    train = [r for r in records(lora_run) if "loss" in r]
    assert len(train) == len(loss)
    for r in train:
        assert 1 <= r["moe/imbalance"] <= EXPERTS and 0 <= r["moe/min_load"] <= 1
        assert 0 < r["moe/router_entropy"] <= math.log(EXPERTS) + 1e-6
        assert "moe/dropped" not in r  # transformers' experts drop nothing
        assert len(r["moe/load"]) == 2  # a router a layer
        for shares in r["moe/load"].values():
            assert len(shares) == EXPERTS and sum(shares) == pytest.approx(1, abs=1e-4)


def test_lora_adapts_attention_by_default_and_the_experts_when_named(qwen_moe):
    def trainable(*items: str) -> set[str]:
        cfg, args = _args(qwen_moe, "lora.rank=8", *items)
        model = apply_lora(FAMILY.build(args), cfg, FAMILY, args)
        return {n.split("layers.0.")[1] for n, p in model.named_parameters() if p.requires_grad and "layers.0." in n}

    default = trainable()
    assert {n.split(".lora_")[0] for n in default} == {f"self_attn.{t}" for t in ATTENTION}
    named = trainable("lora.dropout=0", f"lora.target_modules={LORA['lora.target_modules']}")
    assert default < named
    # The two fused weights of the experts, each with its adapter; the router stays frozen.
    assert named - default == {
        f"mlp.experts.{inner}lora_{ab}.default.weight" for inner in ("", "base_layer.") for ab in "AB"
    }


@pytest.mark.parametrize(
    "items, message",
    [
        (["lora.dropout=0.1"], r"lora\.dropout: 0\.1, .*gate_up_proj .*set lora\.dropout=0"),
        (
            ["lora.dropout=0", "lora.quantize_base=nf4"],
            r"lora\.quantize_base: hf\..*\.layers\.0\.mlp\.experts is a Qwen3MoeExperts; nf4 quantizes linear layers",
        ),
        (
            ["lora.dropout=0", "parallel.strategy=fsdp", "parallel.ep=2"],
            r"lora\.target_modules: adapters on the expert weights gate_up_proj are not split over the expert-parallel",
        ),
    ],
)
def test_expert_targets_with_lora_dropout_or_nf4_or_expert_parallelism_are_refused(qwen_moe, items, message):
    cfg, args = _args(qwen_moe, "lora.rank=8", "lora.target_modules=gate_up_proj", *items)
    with pytest.raises(ConfigError, match=message):
        apply_lora(FAMILY.create(args, "cpu", seed=0), cfg, FAMILY, args)


def test_flops_count_the_router_and_the_experts_a_token_is_routed_to(qwen_moe):
    _, args = _args(qwen_moe)
    c = args.hf_config()
    d, head_dim = c.hidden_size, c.hidden_size // c.num_attention_heads
    attention = 2 * d * head_dim * (c.num_attention_heads + c.num_key_value_heads)
    experts = c.num_experts_per_tok * 3 * d * c.moe_intermediate_size  # of the routed: gate, up, down
    router = c.num_experts * d
    matmul = c.num_hidden_layers * (attention + experts + router) + c.vocab_size * d
    attend = 12 * c.num_hidden_layers * c.num_attention_heads * head_dim * 64
    assert FAMILY.flops_per_token(args, 64) == 6 * matmul + attend


def test_routers_count_in_training_only_and_stay_out_of_the_state_dict(qwen_moe):
    _, args = _args(qwen_moe)
    model = FAMILY.create(args, "cpu", seed=0)
    counts = {n: m for n, m in model.named_modules() if n.endswith(".counts")}
    assert list(counts) == [f"hf.model.layers.{i}.mlp.gate.counts" for i in range(2)]
    assert not [k for k in model.state_dict() if ".counts." in k]
    ids = torch.randint(0, args.hf_config().vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()(ids)
        assert all(m.expert_load.sum() == 0 for m in counts.values())
        model.train()(ids)
    for m in counts.values():
        assert m.expert_load.sum() == 2 * 10 * m.k and m.dropped == 0
        assert 0 < m.entropy <= 20 * math.log(EXPERTS)


def test_the_export_loads_in_transformers_and_as_a_peft_adapter(tmp_path, lora_run, qwen_moe):
    out = tmp_path / "export"
    assert main(["export", str(lora_run), "--format", "hf", "--out", str(out)]) == 0
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen_moe).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        before = base(ids).logits
        ours = load_run(lora_run, device="cpu").model(ids)
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(adapted(ids).logits, ours, rtol=0, atol=1e-5)
    assert (before - ours).abs().max() > 1e-3


def test_mixtral_fine_tunes(tmp_path, sft):
    model_dir = tiny_mixtral(tmp_path / "mixtral", experts=EXPERTS)
    run = tmp_path / "run"
    in_process("train", *sets(ft_sets(run, sft, model_dir, **{"train.max_steps": 4})))
    loss = losses(run)
    assert loss[4] < loss[1]
    assert all(len(r["moe/load"]) == 2 for r in records(run) if "loss" in r)


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_two_ranks_equal_one_process_and_export(tmp_path, sft, qwen_moe, lora_run):
    run = tmp_path / "fsdp"
    items = ft_sets(run, sft, qwen_moe, **LORA, **{"train.micro_batch_size": 1, "parallel.strategy": "fsdp"})
    launch(2, "train", *sets(items))
    got, want = losses(run), losses(lora_run)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    a, b = load_run(run, device="cpu").model.state_dict(), load_run(lora_run, device="cpu").model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)
    # Saved in shards, exported layer by layer: the adapters on the experts fold in there too.
    assert_exports_as(run, tmp_path / "export", lora_run, atol=1e-4)


def assert_exports_as(run: Path, out: Path, reference: Path, atol: float) -> None:
    """``kiln export RUN --format hf`` writes a model transformers loads whose logits are those
    of the ``reference`` run loaded back (within ``atol``)."""
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = load_run(reference, device="cpu").model(ids)
        torch.testing.assert_close(exported(ids).logits, want, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, sft, qwen_moe) -> Path:
    """One process: every weight trained, the experts' too."""
    run = tmp_path_factory.mktemp("full") / "run"
    in_process("train", *sets(ft_sets(run, sft, qwen_moe)))
    return run


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_experts_split_over_two_ranks_train_as_one_process_and_export(tmp_path, sft, qwen_moe, full_run, packing):
    """Each rank holds two of the four experts of every layer (its halves of the fused weights),
    gets the rows its experts are chosen for from both ranks and sends the results back; the
    rest of the model is sharded by FSDP. Saved in shards, the run exports whole."""
    extra = {"data.packing": str(packing).lower()}
    reference = full_run
    if packing:
        reference = tmp_path / "one"
        in_process("train", *sets(ft_sets(reference, sft, qwen_moe, **extra)))
    run = tmp_path / "ep"
    items = ft_sets(run, sft, qwen_moe, **extra, **{"train.micro_batch_size": 1, "parallel.strategy": "fsdp"})
    launch(2, "train", *sets([*items, "parallel.ep=2"]))
    assert_trains_as(run, reference)
    if not packing:
        assert_exports_as(run, tmp_path / "export", run, atol=1e-5)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "extra",
    [
        {"lora.rank": 8, "lora.dropout": 0, "lora.quantize_base": "nf4"},
        {"run.job": "dpo", "data.seq_len": 48, "train.lr": 1e-3},
    ],
    ids=["qlora", "dpo"],
)
def test_objectives_and_adapters_with_experts_split_over_two_ranks_equal_one_process(tmp_path, sft, qwen_moe, extra):
    """QLoRA (a 4-bit base under the attention's adapters, its projections wide enough for FSDP to
    split their NF4 scales; the experts' fused weights, frozen, split over the ranks) and DPO (its
    reference precomputed in the run's own layout)."""
    from test_preference_objectives import preference_records

    source, model = sft, qwen_moe
    if extra.get("run.job") == "dpo":
        source = write_jsonl(tmp_path / "pairs.jsonl", preference_records(64))
    else:
        wide = dict(hidden_size=128, head_dim=64, num_key_value_heads=4)
        model = tiny_qwen3_moe(tmp_path / "wide", experts=EXPERTS, **wide)
    one, run = tmp_path / "one", tmp_path / "ep"
    in_process("train", *sets(ft_sets(one, source, model, **extra)))
    items = ft_sets(run, source, model, **extra, **{"train.micro_batch_size": 1, "parallel.strategy": "fsdp"})
    launch(2, "train", *sets([*items, "parallel.ep=2"]))
    assert_trains_as(run, one)
