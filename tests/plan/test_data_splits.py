"""kiln plan when the data-parallel ranks also split the model's work: expert parallelism (a
mixture of experts' experts split over them, tokens sent to their experts by all-to-all) and
context parallelism (each sequence split over them, keys and values gathered): what a rank
gathers and keeps, the communication and its link, the setups recommended where they pay, and
the refusals."""

import json

import pytest

from kiln.cli import main
from kiln.config import all_keys, load_config
from kiln.models.family import MemoryContext
from kiln.models.gpt import FAMILY
from kiln.plan import make_plan, model_state

NVLINK = 0.8 * 450e9  # the default for an H100
# Qwen3-30B-A3B's shape: 48 layers, each with 128 experts of d_expert 768 (8 a token), d_model 2048.
QWEN3 = [
    "model.preset=qwen3-30b-a3b",
    "data.vocab_size=151936",
    "data.seq_len=4096",
    "train.precision=bf16",
    "train.global_batch_size=64",
    "train.micro_batch_size=1",
    "parallel.strategy=fsdp",
]
EXPERTS = 3 * 128 * 768 * 2048  # a layer's expert weights: w1, w3 and w2 of every expert
# A Llama-3-8B-shaped model at 128K tokens a sequence, 8 sequences a step.
LONG = [
    "model.preset=llama3-8b",
    "data.vocab_size=128256",
    "data.seq_len=131072",
    "train.precision=bf16",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
]
FORWARD = "forward: output layer and loss"


def sets(items):
    return [a for item in items for a in ("--set", item)]


def plan_of(items, **kwargs):
    kwargs = {"gpu": "h100", "device_memory": "80GB", "top": 1, **kwargs}
    return make_plan(load_config(None, items), **kwargs)


# -- expert parallelism --------------------------------------------------------------------------


def test_expert_parallelism_gathers_only_a_rank_s_own_experts():
    plans = {ep: plan_of([*QWEN3, f"parallel.ep={ep}"], world_size=8) for ep in (1, 4, 8)}
    forward = {ep: plan.memory.phases[FORWARD] for ep, plan in plans.items()}
    # Each rank stores the same shards: its experts split over ep, sharded over the dp / ep others.
    stored = {ep: model_state(plan.job.shape, plan.base) for ep, plan in plans.items()}
    assert stored[1] == stored[4] == stored[8]
    # fsdp holds two blocks gathered at once, in bf16: with ep = 4 a quarter of their experts.
    gathered = {ep: parts["gathered_parameters"] for ep, parts in forward.items()}
    assert gathered[1] - gathered[4] == 2 * 2 * EXPERTS * 3 // 4
    # With ep = dp no other rank holds a rank's experts: FSDP leaves them alone, in fp32, and the
    # grouped matrix multiply casts them to bf16 itself, an eighth of every layer's experts.
    assert gathered[1] - gathered[8] == 2 * 2 * EXPERTS
    assert forward[8]["autocast_weight_copies"] == 48 * 2 * EXPERTS // 8
    assert forward[1].get("autocast_weight_copies", 0) == 0


def test_expert_parallel_all_to_alls_are_on_the_critical_path_over_their_link():
    one = plan_of([*QWEN3, "parallel.ep=1"], world_size=8).time
    t = plan_of([*QWEN3, "parallel.ep=8"], world_size=8).time
    assert one.expert_parallel == 0 and "expert_parallel" not in one.links
    assert t.links["expert_parallel"] == "nvlink"
    # Per layer and micro-batch of 4,096 tokens: each token's 8 copies of its d_model input (bf16)
    # out to its experts' ranks and their outputs (bf16) back, forward and backward; a rank sends
    # 7/8 of each buffer to the others. Each of the 8 ranks takes 8 micro-batches of the 64.
    per_layer = 2 * (2 + 2) * 7 / 8 * 4096 * 8 * 2048
    assert t.expert_parallel == pytest.approx(8 * 48 * per_layer / NVLINK)
    assert t.total == pytest.approx(t.compute + t.expert_parallel + t.data_parallel)
    # FSDP now moves only the dense parameters (4% of the model).
    assert t.data_parallel_traffic < one.data_parallel_traffic / 10
    # Expert-parallel ranks are adjacent: 16 of them span two nodes, 8 of 16 GPUs stay in one.
    assert plan_of([*QWEN3, "parallel.ep=16"], world_size=16).time.links["expert_parallel"] == "network"
    assert plan_of([*QWEN3, "parallel.ep=8"], world_size=16).time.links["expert_parallel"] == "nvlink"


def test_a_mixture_of_experts_that_gathers_too_much_is_recommended_expert_parallelism():
    """DeepSeek-V3's shape on 256 H100s: 672B parameters, 21 GiB of bf16 experts in each of its
    58 MoE layers. FSDP over all 256 ranks stores 41 GiB a rank, but gathers a layer's experts
    whole: nothing fits without splitting them."""
    items = ["model.preset=deepseek-v3", "data.vocab_size=129280", "data.seq_len=4096", "train.precision=bf16"]
    items += ["train.global_batch_size=1024", "train.micro_batch_size=1"]
    plan = plan_of(items, nodes=32, gpus_per_node=8, top=3)
    assert not plan.fits and plan.recommendations
    for rec in plan.recommendations:
        assert rec.setup.ep > 1 and rec.setup.world_size == 256, rec.overrides
        assert rec.time.expert_parallel > 0 and rec.memory.total <= 80e9
    assert "parallel.ep" in {item.split("=")[0] for item in plan.recommendations[0].overrides}


# -- context parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize("preset, cp", [("llama3-8b", 2), ("llama3-8b", 4), ("7b", 2)])
def test_context_parallel_activations_keep_the_whole_sequences_keys_and_values(preset, cp):
    """The count docs/plan.md compares with saved-tensor hooks on gloo ranks (bench/cp_memory.py)."""
    cfg = load_config(None, [f"model.preset={preset}", "data.vocab_size=32000", "data.seq_len=8192"])
    args = FAMILY.resolve(cfg.model, vocab_size=32000, seq_len=8192)
    memory = FAMILY.memory_model(args)

    def block(tokens: int, cp: int) -> int:  # bf16 autocast, a bf16 residual stream under FSDP
        return memory.block_activations(MemoryContext(tokens, True, 2, 1, False, 8192, cp))

    whole, local = block(8192, 1), block(8192 // cp, 1)
    # A rank keeps 1/cp of every activation but SDPA's keys and values, which are the whole
    # sequence's, repeated to every query head (llama3-8b has 8 key heads for 32 query heads).
    width = args.n_head * args.head_dim
    assert block(8192 // cp, cp) - local == 2 * 2 * width * (8192 - 8192 // cp)
    assert local < block(8192 // cp, cp) < whole


def test_a_sequence_too_long_for_a_gpu_is_split_over_a_context_parallel_group():
    plan = plan_of(LONG, world_size=8, top=3)
    assert not plan.fits and plan.recommendations
    # Nothing fits with whole sequences: FSDP with checkpointing keeps the least of them.
    least = [*LONG, "parallel.strategy=fsdp", "train.activation_checkpointing=true"]
    whole, split = plan_of(least, world_size=8), plan_of([*least, "parallel.cp=2"], world_size=8)
    assert not whole.fits and split.fits
    kept = [p.memory.phases["backward: first block"]["activations"] for p in (split, whole)]
    assert kept[0] < kept[1]
    for rec in plan.recommendations:
        assert "parallel.cp" in {item.split("=")[0] for item in rec.overrides}, rec.overrides
        again = plan_of(LONG + rec.overrides, world_size=8)
        assert again.fits and again.memory.total == rec.memory.total
    best = plan.recommendations[0]
    s, t = best.setup, best.time
    assert t.links["context_parallel"] == "nvlink"
    # Each of the 8 / cp groups reads 8 / (8 / cp) sequences, each rank computing 1 / cp of each.
    rounds = 8 // (8 // s.cp) // s.micro_batch_size
    tokens = s.micro_batch_size * 131072
    # Per block: all-gathers of the whole sequences' bf16 keys and values (8 heads of 128)
    # forward, again when checkpointing recomputes it, reduce-scatters of their gradients back.
    passes = 3 if s.activation_checkpointing else 2
    per_block = passes * (s.cp - 1) / s.cp * 2 * tokens * 1024 * 2
    assert t.context_parallel == pytest.approx(rounds * 32 * per_block / NVLINK)


# -- the command line ----------------------------------------------------------------------------


def test_the_output_shows_the_split_and_its_communication(capsys):
    argv = ["plan", *sets([*QWEN3, "parallel.ep=8"]), "--gpu", "h100", "--device-memory", "80GB", "--world-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    layout = "pipeline 1 x data-parallel 8 (expert-parallel 8) x tensor-parallel 1"
    assert f"  layout: {layout} (parallel.pp=1, parallel.tp=1, parallel.ep=8)," in out
    assert "expert-parallel all-to-alls (nvlink), not overlapped" in out
    assert "note: a mixture of experts is timed at a dense model's compute efficiency" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["device"]["ep"], plan["setup"]["ep"], plan["setup"]["cp"]) == (8, 8, 1)
    time = plan["time"]
    parts = ("compute", "tensor_parallel", "expert_parallel", "context_parallel", "data_parallel")
    parts += ("pipeline_sends", "bubble", "offload")
    assert time["seconds"] == pytest.approx(sum(time[p] for p in parts))
    assert time["links"]["expert_parallel"] == "nvlink"
    for rec in plan["recommendations"]:
        assert all(item.split("=")[0] in all_keys() for item in rec["overrides"])

    argv = ["plan", *sets([*LONG, "parallel.cp=4"]), "--gpu", "h100", "--device-memory", "80GB", "--world-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "data-parallel 8 (context-parallel 4)" in out and "parallel.cp=4" in out
    assert "context-parallel key/value all-gathers (nvlink), not overlapped" in out


@pytest.mark.parametrize(
    "items, message",
    [
        ([*QWEN3, "parallel.ep=3"], "parallel.ep: 3 must divide the data-parallel ranks, 8"),
        (
            [*QWEN3, "parallel.ep=8", "model.n_experts=12"],
            "parallel.ep: 8 must divide the model's 12 experts a layer (model.n_experts",
        ),
        ([*QWEN3, "parallel.ep=2", "parallel.strategy=ddp"], "parallel.ep: experts split over ranks need"),
        (["model.preset=tiny", "parallel.ep=2", "parallel.strategy=fsdp"], "parallel.ep: the model has no experts"),
        (["model.preset=tiny", "parallel.cp=3", "data.seq_len=96"], "parallel.cp: 3 must divide the data-parallel"),
        (["model.preset=tiny", "parallel.cp=2", "data.seq_len=98"], "parallel.cp: each sequence is cut into 2 x"),
        (
            ["model.preset=tiny", "parallel.cp=2", "train.global_batch_size=6"],
            "train.global_batch_size: 6 is not divisible by the 4 data-parallel ranks (--world-size 8 / "
            "parallel.pp 1 / parallel.tp 1 / parallel.cp 2)",
        ),
    ],
)
def test_layouts_kiln_train_refuses_exit_2_naming_the_key(capsys, items, message):
    argv = ["plan", *sets(["train.micro_batch_size=1", *items]), "--gpu", "h100", "--world-size", "8"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
