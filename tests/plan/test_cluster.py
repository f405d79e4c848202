"""kiln plan at cluster scale: layouts over nodes (pipeline x data-parallel x tensor-parallel),
the time model's arithmetic (bubble, collective volumes, links, MFU, scaling efficiency),
pipeline memory, the recommended layouts for Llama-3-shaped models, and the command line."""

import json

import pytest

from kiln.cli import main
from kiln.config import all_keys, load_config
from kiln.plan import make_plan, model_state
from kiln.plan.estimate import pipeline_stages
from kiln.plan.format import bubble_fraction

H100 = 989e12
NVLINK, NETWORK = 0.8 * 450e9, 0.8 * 50e9  # the defaults for an H100 cluster
LLAMA3 = ["data.vocab_size=128256", "data.seq_len=8192", "train.precision=bf16"]
# Llama 3 8B as torchtitan ran it on 8 H100s: global batch 16 of 8,192 tokens.
EIGHT_B = ["model.preset=llama3-8b", *LLAMA3, "train.global_batch_size=16", "train.micro_batch_size=1"]
SEVENTY_B = ["model.preset=llama3-70b", *LLAMA3, "train.global_batch_size=64", "train.micro_batch_size=1"]
# Four untied layers: small enough to plan in milliseconds, deep enough for 2- and 4-stage pipelines.
TINY = ["model.preset=tiny", "model.tie_embeddings=false", "data.vocab_size=1024", "data.seq_len=256"]


def sets(items):
    return [a for item in items for a in ("--set", item)]


def plan_of(items, **kwargs):
    kwargs = {"gpu": "h100", "device_memory": "80GB", **kwargs}
    return make_plan(load_config(None, items), **kwargs)


# -- layout arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pp, schedule, virtual, microbatches, fraction",
    [
        (1, "1f1b", 1, 0, 0.0),
        (4, "1f1b", 1, 4, 3 / 7),
        (4, "gpipe", 1, 16, 3 / 19),
        (2, "interleaved_1f1b", 2, 8, 1 / 17),
    ],
)
def test_bubble_is_the_idle_share_of_the_schedule(pp, schedule, virtual, microbatches, fraction):
    items = [
        *TINY,
        f"parallel.pp={pp}",
        f"parallel.pp_schedule={schedule}",
        f"parallel.pp_virtual_stages={virtual}",
        f"parallel.pp_microbatches={microbatches}",
        "train.global_batch_size=32",
        "train.micro_batch_size=16",
    ]
    plan = plan_of(items, world_size=pp)
    t = plan.time
    assert bubble_fraction(plan.base) == pytest.approx(fraction)
    # One data-parallel rank: the schedule is all compute, sends and bubble.
    schedule_time = t.compute + t.tensor_parallel + t.pipeline_sends + t.bubble
    assert t.bubble == pytest.approx(fraction * schedule_time)
    assert t.total == pytest.approx(schedule_time)


def test_one_gpu_is_the_scaling_reference():
    plan = plan_of([*TINY, "train.global_batch_size=8", "train.micro_batch_size=4"])
    t = plan.time
    assert t.total == t.compute and t.scaling_efficiency == pytest.approx(1.0)
    assert plan.job.mfu(plan.base) == pytest.approx(plan.job.flops_per_step / (H100 * t.total))


def test_fsdp_moves_two_bf16_gathers_and_an_fp32_reduce_scatter_per_micro_batch():
    plan = plan_of([*EIGHT_B, "parallel.strategy=fsdp", "train.activation_checkpointing=true"], world_size=8)
    t, n = plan.time, plan.job.shape.num_params()
    rounds = 16 // 8 // 1  # each rank's sequences, one per micro-batch
    assert t.links["data_parallel"] == "nvlink"
    assert t.data_parallel_traffic == pytest.approx(rounds * 7 / 8 * (2 * 2 * n + 4 * n) / NVLINK)
    # Hidden behind the compute but for each micro-batch's first all-gather and last
    # reduce-scatter: of the root (embedding, final norm, output layer) and of one block.
    root = 2 * 128256 * 4096 + 4096
    edge = root + (n - root) / 32
    assert t.data_parallel == pytest.approx(rounds * 7 / 8 * (2 + 4) * edge / NVLINK)
    assert t.data_parallel < 0.2 * t.data_parallel_traffic


def test_ddp_all_reduces_fp32_gradients_once_per_step():
    plan = plan_of(
        ["model.preset=1b", "data.vocab_size=32000", "data.seq_len=2048", "train.global_batch_size=64"]
        + ["train.micro_batch_size=8"],
        world_size=8,
    )
    n = plan.job.shape.num_params()
    assert plan.base.strategy == "ddp"
    assert plan.time.data_parallel_traffic == pytest.approx(2 * 7 / 8 * 4 * n / NVLINK)


def test_tensor_parallel_all_reduces_are_activation_sized_and_on_the_critical_path():
    plan = plan_of([*EIGHT_B, "parallel.tp=8"], world_size=8)
    t, d = plan.time, 4096
    tokens = 1 * 8192
    # Per block and micro-batch: two bf16 all-reduces forward, two fp32 ones (the blocks' input
    # gradients) backward, each a ring all-reduce of [tokens, d_model].
    per_block = (2 * 2 + 2 * 4) * tokens * d * 2 * 7 / 8 / NVLINK
    assert t.links["tensor_parallel"] == "nvlink"
    assert t.tensor_parallel == pytest.approx(16 * 32 * per_block)  # 16 micro-batches, 32 blocks
    assert t.total == pytest.approx(t.compute + t.tensor_parallel)


def test_groups_that_span_nodes_use_the_network():
    items = [*SEVENTY_B, "parallel.strategy=fsdp", "parallel.tp=8", "train.activation_checkpointing=true"]
    one_node = plan_of(items, nodes=1, gpus_per_node=8).time
    eight = plan_of(items, nodes=8, gpus_per_node=8).time
    assert one_node.links == {"tensor_parallel": "nvlink"}  # 8 GPUs: tensor-parallel only
    assert eight.links == {"tensor_parallel": "nvlink", "data_parallel": "network"}
    # Tensor parallelism wider than a node goes over the network as well.
    narrow = plan_of(items, nodes=16, gpus_per_node=4)
    assert narrow.time.links["tensor_parallel"] == "network"
    assert any("spans nodes" in note for note in narrow.notes)


def test_bandwidth_overrides_scale_the_collectives():
    items = [*SEVENTY_B, "parallel.strategy=fsdp", "train.activation_checkpointing=true"]
    default = plan_of(items, nodes=8, gpus_per_node=8)
    faster = plan_of(items, nodes=8, gpus_per_node=8, bandwidth="network=80")
    assert faster.job.cluster.network == 80e9 and faster.job.cluster.nvlink == NVLINK
    assert faster.time.data_parallel_traffic == pytest.approx(default.time.data_parallel_traffic * NETWORK / 80e9)
    assert faster.time.compute == default.time.compute


def test_compute_efficiency_sets_the_compute_rate():
    items = [*TINY, "train.global_batch_size=8", "train.micro_batch_size=8"]
    assert plan_of(items).time.compute == pytest.approx(2 * plan_of(items, compute_efficiency=0.8).time.compute)
    assert plan_of(items).job.cluster.efficiency == 0.40
    assert plan_of(items, gpu="a100").job.cluster.efficiency == 0.60


# -- pipeline memory ---------------------------------------------------------------------------


def test_stages_hold_their_share_of_the_layers_and_the_root():
    plan = plan_of([*EIGHT_B, "parallel.pp=4", "train.micro_batch_size=4", "parallel.pp_microbatches=4"], world_size=4)
    first, last = pipeline_stages(plan.job.shape, plan.base)
    assert (first.blocks, last.blocks) == (8, 8)
    assert [p.name for p in first.root] == ["tok_emb"] and [p.name for p in last.root] == ["norm", "lm_head"]
    whole = plan_of(EIGHT_B, world_size=4, top=1)
    total = model_state(whole.job.shape, whole.base)["parameters"]
    embedding = 128256 * 4096 * 4
    per_stage = (total - 2 * embedding - 4096 * 4) / 4
    assert model_state(plan.job.shape, plan.base, first)["parameters"] == per_stage + embedding
    # 1f1b: the first stage holds p pipeline micro-batches in flight, the last one.
    assert (first.in_flight, last.in_flight) == (4, 1)
    assert plan.memory.peak_phase.startswith("first stage")


def test_stages_of_given_sizes_are_planned_by_their_own_layers_and_the_heaviest_sets_the_time():
    items = [*EIGHT_B, "parallel.pp=4", "train.micro_batch_size=4", "parallel.pp_microbatches=4"]
    equal = plan_of(items, world_size=4)
    # Llama 3 405B's recipe in small: the embedding's and the output layer's stages lighter.
    lighter_ends = plan_of([*items, "parallel.pp_layers=7,9,9,7"], world_size=4)
    first, last, middle = pipeline_stages(lighter_ends.job.shape, lighter_ends.base)
    assert (first.blocks, last.blocks, middle.blocks) == (7, 7, 9)
    assert lighter_ends.memory.allocated < equal.memory.allocated  # the first stage set the peak
    # A heavy last stage (the output layer and more layers) is the pipeline's slowest.
    heavy_end = plan_of([*items, "parallel.pp_layers=6,6,6,14"], world_size=4)
    assert heavy_end.time.total > 1.5 * equal.time.total
    assert "parallel.pp_layers=6,6,6,14" in heavy_end.base.overrides(equal.base)


def test_gpipe_holds_every_micro_batch_and_needs_more_memory_than_1f1b():
    items = [
        *TINY,
        "parallel.pp=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        "parallel.pp_microbatches=8",
    ]
    one_f_one_b = plan_of(items, world_size=2)
    gpipe = plan_of([*items, "parallel.pp_schedule=gpipe"], world_size=2)
    assert pipeline_stages(gpipe.job.shape, gpipe.base)[0].in_flight == 8
    assert gpipe.memory.allocated > one_f_one_b.memory.allocated
    assert gpipe.memory.components["pipeline_activations"] > 0


def test_fsdp_in_a_pipeline_accumulates_unsharded_gradients():
    """torch's PipelineStage reduce-scatters once, after the last pipeline micro-batch."""
    items = [*TINY, "parallel.pp=2", "parallel.strategy=fsdp", "train.global_batch_size=16", "train.micro_batch_size=4"]
    plan = plan_of(items, world_size=8)
    first = pipeline_stages(plan.job.shape, plan.base)[0]
    sharded = model_state(plan.job.shape, plan.base, first)["gradients"]
    backward = plan.memory.phases["first stage, backward: first block"]["gradients"]
    assert backward > 3 * sharded  # 4 data-parallel ranks: the unsharded gradients are 4 times the shards
    assert plan.memory.phases["first stage, optimizer step"]["gradients"] == sharded


# -- recommendations ---------------------------------------------------------------------------


def test_8b_on_one_node_of_80gb_gpus_gets_a_layout_that_fits():
    plan = plan_of(EIGHT_B, nodes=1, gpus_per_node=8)
    assert not plan.fits  # DDP, as configured: 16 bytes of model state per parameter
    assert plan.recommendations
    best = plan.recommendations[0]
    assert best.memory.total <= 80e9 and best.setup.world_size == 8
    assert best.setup.strategy != "ddp" or best.setup.tp * best.setup.pp > 1
    assert best.seconds == min(r.seconds for r in plan.recommendations)
    assert plan.job.mfu(best.setup) > 0.2


def test_70b_on_64_80gb_gpus_is_not_plain_ddp_and_fits():
    plan = plan_of(SEVENTY_B, nodes=8, gpus_per_node=8)
    assert not plan.fits
    for rec in plan.recommendations:
        s = rec.setup
        assert s.world_size == 64 and rec.memory.total <= 80e9
        assert not (s.strategy == "ddp" and s.dp > 1), rec.overrides  # never replicate 70B parameters
        assert s.sharded or s.tp * s.pp >= 8
    assert 0.2 < plan.job.mfu(plan.recommendations[0].setup) < 0.4


def test_a_small_model_on_one_node_keeps_data_parallelism():
    items = ["model.preset=1b", "data.vocab_size=32000", "data.seq_len=2048", "train.global_batch_size=64"]
    plan = plan_of([*items, "train.micro_batch_size=8"], world_size=8)
    best = plan.recommendations[0].setup
    assert plan.fits and (best.pp, best.tp) == (1, 1)


def test_recommended_overrides_reproduce_their_estimate(capsys):
    assert main(["plan", *sets(SEVENTY_B), "--gpu", "h100", "--device-memory", "80GB", "--nodes", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommendations"]
    for rec in plan["recommendations"]:
        assert all(item.split("=")[0] in all_keys() for item in rec["overrides"])
        again = plan_of(SEVENTY_B + rec["overrides"], nodes=rec["nodes"], gpus_per_node=8)
        assert again.fits and again.memory.total == rec["memory"]["total"]
        assert again.time.total == pytest.approx(rec["time"]["seconds"])


# -- the command line --------------------------------------------------------------------------


def test_json_reports_the_cluster_the_assumptions_and_the_time_parts(capsys):
    items = [*SEVENTY_B, "parallel.strategy=fsdp", "parallel.tp=8", "train.activation_checkpointing=true"]
    argv = ["plan", *sets(items), "--gpu", "h100", "--device-memory", "80GB", "--nodes", "8", "--gpus-per-node", "8"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    device, time = plan["device"], plan["time"]
    assert (device["world_size"], device["nodes"], device["gpus_per_node"]) == (64, 8, 8)
    assert (device["pp"], device["dp"], device["tp"]) == (1, 8, 8)
    assert plan["assumptions"]["bandwidth"] == {"nvlink": NVLINK, "network": NETWORK, "pcie": 25e9}
    assert plan["assumptions"]["compute_efficiency"] == 0.40
    parts = ("compute", "tensor_parallel", "data_parallel", "pipeline_sends", "bubble", "offload")
    assert time["seconds"] == pytest.approx(sum(time[p] for p in parts))
    assert time["mfu"] == pytest.approx(time["flops_per_step"] / (64 * H100 * time["seconds"]))
    assert time["tokens_per_second_per_gpu"] == pytest.approx(64 * 8192 / time["seconds"] / 64)
    assert 0 < time["scaling_efficiency"] <= 1
    assert sum(r["is_config"] for r in plan["recommendations"]) <= 1

    assert main(argv) == 0
    out = capsys.readouterr().out
    for words in (
        "8 nodes x 8 GPUs",
        "tensor-parallel all-gathers and reduce-scatters (nvlink)",
        "MFU",
        "scaling efficiency",
        "assumptions",
    ):
        assert words in out
    assert "nvlink 360 GB/s" in out and "network 40 GB/s" in out


def test_a_pipeline_shows_its_schedule_and_bubble(capsys):
    items = [*TINY, "parallel.pp=4", "train.global_batch_size=16", "train.micro_batch_size=8"]
    assert main(["plan", *sets(items), "--gpu", "h100", "--device-memory", "80GB", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "parallel.pp_schedule=1f1b, parallel.pp_microbatches=4 (2 sequences each)" in out
    assert "pipeline bubble: 42.9% of the schedule idle" in out


def test_world_size_alone_means_nodes_of_eight():
    by_world = plan_of(EIGHT_B, world_size=16, top=1)
    by_nodes = plan_of(EIGHT_B, nodes=2, gpus_per_node=8, top=1)
    assert by_world.job.cluster.nodes(16) == 2 and by_world.job.cluster == by_nodes.job.cluster
    assert plan_of(EIGHT_B, nodes=2, top=1).base.world_size == 16


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--world-size", "12", "--nodes", "2", "--gpus-per-node", "8"],
            "--world-size: 12 is not --nodes 2 x --gpus-per-node 8",
        ),
        (["--world-size", "12"], "--world-size: 12 GPUs do not fill whole nodes of 8 GPUs"),
        (["--world-size", "16", "--nodes", "3"], "--world-size: 16 GPUs do not split evenly over --nodes 3"),
        (["--nodes", "0"], "--nodes: must be >= 1"),
        (["--bandwidth", "infiniband=50"], "--bandwidth: 'infiniband=50' is not LINK=GB/s"),
        (["--bandwidth", "nvlink=fast"], "--bandwidth: 'nvlink=fast' is not LINK=GB/s"),
        (["--compute-efficiency", "1.5"], "--compute-efficiency: must be above 0 and at most 1"),
        (["--top", "0"], "--top: must be >= 1"),
        (
            ["--world-size", "8", *sets(["parallel.pp=3", "train.micro_batch_size=3", "train.global_batch_size=3"])],
            "--world-size: 8 is not a multiple of parallel.pp x parallel.tp = 3 x 1 = 3",
        ),
        (
            ["--nodes", "1", "--gpus-per-node", "6", *sets(["parallel.pp=4", "parallel.tp=2"])],
            "--nodes x --gpus-per-node: 6 is not a multiple of parallel.pp x parallel.tp = 4 x 2 = 8",
        ),
        (
            ["--world-size", "8", *sets(["parallel.pp=8", "train.micro_batch_size=8", "train.global_batch_size=8"])],
            "parallel.pp: the model's 4 layers do not split into 8 equal pipeline stages",
        ),
    ],
)
def test_bad_cluster_input_exits_2_naming_the_option(capsys, args, message):
    assert main(["plan", "--gpu", "h100", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_selective_checkpointing_compile_float8_and_tensor_parallel_splits_are_modelled():
    from kiln.models.family import MemoryContext
    from kiln.plan.estimate import COMPILED_SPEEDUP, FP8_SPEEDUP, SELECTIVE_TIME

    items = [*EIGHT_B, "train.compile=false"]

    def compute(*more):
        return plan_of([*items, *more], world_size=8).time.compute

    none = compute("train.activation_checkpointing=false")
    selective = compute("train.activation_checkpointing=selective")  # the blocks recomputed in part, not the head
    assert none < selective < none * SELECTIVE_TIME < compute("train.activation_checkpointing=true")
    assert compute("train.activation_checkpointing=false", "train.compile=true") == pytest.approx(
        none / COMPILED_SPEEDUP
    )
    assert compute("train.activation_checkpointing=false", "train.precision=fp8") == pytest.approx(none / FP8_SPEEDUP)
    # Under tensor parallelism with sequence parallelism a rank keeps its positions of the residual
    # stream and norms, and its share of the vocabulary's logits; loss parallelism splits the
    # output layer's FLOPs too.
    plan = plan_of([*items, "parallel.tp=2", "parallel.strategy=fsdp"], world_size=8)
    assert plan.job.shape.head_split
    memory = plan.job.shape.memory
    ctx = dict(tokens=8192, autocast=True, residual_bytes=2, tp=2, casts_weights=False)
    whole, split = MemoryContext(**ctx), MemoryContext(**ctx, sequence_parallel=True)
    assert memory.block_activations(split) < memory.block_activations(whole)
    assert memory.after_blocks(split) * 2 == pytest.approx(memory.after_blocks(whole), rel=1e-3)
    assert memory.head(split).saved < memory.head(whole).saved


def test_hsdp_shards_within_a_node_and_all_reduces_over_the_replicas():
    """HSDP 8 x 8 on 64 GPUs: each replica's shards gathered over NVLink, only the gradients'
    shards all-reduced over the network; more memory a rank (its shards are 1/8, not 1/64)."""
    items = [*EIGHT_B, "parallel.strategy=fsdp", "train.global_batch_size=64", "train.activation_checkpointing=true"]
    fsdp = plan_of(items, nodes=8, gpus_per_node=8)
    hsdp = plan_of([*items, "parallel.dp_replicate=8"], nodes=8, gpus_per_node=8)
    assert hsdp.time.links["data_parallel"] == "nvlink" and hsdp.time.links["data_parallel_replicas"] == "network"
    assert fsdp.time.links["data_parallel"] == "network"
    assert hsdp.time.data_parallel_traffic < fsdp.time.data_parallel_traffic
    assert hsdp.memory.components["parameters"] == pytest.approx(8 * fsdp.memory.components["parameters"], rel=0.01)
