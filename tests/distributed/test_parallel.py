"""Scale-out through the real launcher: ``kiln launch`` (torchrun) with gloo processes on the CPU.

Every strategy must change speed, not results: losses and final weights are compared with one
process training on the same global batch (``single``; the runs are shared, see tests/layouts.py).
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from kiln.train.run import load_run

from conftest import tiny_overrides
from kilnrun import free_port, in_process, kiln, launch, losses, records, start
from layouts import (
    GLOBAL,
    STEPS,
    assert_same_training,
    layout_sets,
    resumable_copy,
    started,
    train_on,
    weights,
)


def test_ddp_two_ranks_equal_one_process_with_twice_the_micro_batch(ddp_run, single):
    run_dir, proc = ddp_run  # watched by the hang watchdog too (test_watchdog.py), which changes no result
    assert_same_training(run_dir, single)
    # Only rank 0 prints progress.
    assert proc.stdout.count(f"step {STEPS}/{STEPS}") == 2  # the train line and the val line
    assert json.loads((run_dir / "env.json").read_text())["world_size"] == 2


def test_fsdp_equals_one_process_and_saves_a_shard_per_rank(fsdp_run, single):
    assert_same_training(fsdp_run, single)
    # Sharded weights are saved with torch.distributed.checkpoint, one file per rank.
    state = fsdp_run / "checkpoints" / f"step-{STEPS:08d}" / "state"
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_a_sharded_checkpoint_exports_like_a_whole_one(tmp_path, fsdp_run, single):
    assert list((fsdp_run / "checkpoints" / f"step-{STEPS:08d}" / "state").glob("*.distcp"))
    ids = torch.randint(0, 512, (3, 32))
    for fmt in ("safetensors", "hf"):
        outputs = []
        for name, source in (("sharded", fsdp_run), ("whole", single)):
            out = tmp_path / f"{fmt}-{name}"
            # Files of 40 kB at most: split, with an index, whether written whole or streamed.
            in_process("export", source, "--format", fmt, "--out", out, "--max-shard-size", "40kB")
            info = json.loads((out / "export.json").read_text())
            assert info[fmt]["max_abs_diff"] <= 1e-5  # the artifact computes the gathered model
            assert ("streamed" in info) == (name == "sharded") and (out / "model.safetensors.index.json").is_file()
            # The same files besides the weights, and the same tensors in them (grouped otherwise:
            # a stream writes layer by layer, a whole model in its state dict's order).
            others = sorted(f for f in info["files"] if not f.startswith("model-"))
            tensors = sorted(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
            outputs.append(((others, tensors), load_run(out, device="cpu").model(ids).detach()))
        (sharded_files, sharded), (whole_files, whole) = outputs
        assert sharded_files == whole_files
        # The two runs trained alike (to Adam's amplified rounding, see assert_same_training).
        torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-3)


@pytest.mark.parametrize(
    "strategy, micro, extra",
    [
        ("fsdp_grad_op", 2, {}),
        ("ddp", 4, {"parallel__tp": 2}),  # tensor parallel over both ranks, data-parallel degree 1
        # Compiled: the layers around the vocabulary-parallel loss, which stays eager.
        ("ddp", 4, {"parallel__tp": 2, "train__compile": "true"}),
    ],
    ids=["fsdp_grad_op", "tp", "tp-compiled"],
)
@pytest.mark.slow
def test_sharded_strategies_equal_one_process(tmp_path, corpus_dir, single, strategy, micro, extra):
    run_dir = tmp_path / "run"
    train_on(2, layout_sets(run_dir, corpus_dir, micro=micro, parallel__strategy=strategy, **extra))
    assert_same_training(run_dir, single)
    # Sharded weights are saved with torch.distributed.checkpoint, one file per rank.
    state = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state"
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_out_of_memory_on_ranks_restarts_at_the_smaller_micro_batch(tmp_path, corpus_dir, single):
    """Ranks cannot retry a step alone (the others wait in collectives): the rung is saved in
    memory.json, the agent restarts the group, and the run resumes from its checkpoint there."""
    run_dir = tmp_path / "oom"
    # Out of memory above one sequence, after the checkpoint at step 3.
    faults = dict(debug__oom_above=1, debug__oom_from_step=4)
    sets = layout_sets(run_dir, corpus_dir, micro=2, **faults)
    proc = train_on(2, sets, "--max-restarts", "1", "--monitor-interval", "0.2")
    assert "out of memory at step 5 with micro-batch 2" in proc.stderr
    assert json.loads((run_dir / "memory.json").read_text())["micro_batch_size"] == 1
    assert "resumed from" in proc.stdout
    assert_same_training(run_dir, single)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp", "hsdp"])
def test_fsdp_bf16_computes_in_bf16_and_keeps_fp32_weights(tmp_path, corpus_dir, single, replicas):
    """Two FSDP ranks, or HSDP's two replicas of them (4 ranks)."""
    run_dir = tmp_path / "bf16"
    layout = dict(parallel__strategy="fsdp", parallel__dp_replicate=replicas, train__precision="bf16")
    train_on(2 * replicas, layout_sets(run_dir, corpus_dir, micro=2, **layout))
    got, want = losses(run_dir), losses(single)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=2e-2), f"loss at step {step}"
    assert got != want  # bf16 compute really happened: not bit-equal to the fp32 run
    # The master weights (and what the checkpoint holds) stay fp32.
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state")).read_metadata()
    dtypes = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes


@pytest.mark.slow
def test_fsdp_fp16_trains_as_ddp_with_one_loss_scale(tmp_path, corpus_dir):
    """Each FSDP rank unscales its own shards of the gradients, where DDP's hold them whole; the
    scale, its halving or growth and the skip follow the global gradient norm, the same on every
    rank. Against DDP, whose ranks compute the same fp16 products on the same micro-batches (one
    process's micro-batches of other shapes round apart by about 3e-5 in fp16)."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    train_on(2, layout_sets(ddp, corpus_dir, micro=2, parallel__strategy="ddp", train__precision="fp16"))
    train_on(2, layout_sets(fsdp, corpus_dir, micro=2, parallel__strategy="fsdp", train__precision="fp16"))
    assert_same_training(fsdp, ddp, atol=5e-4)  # fp16 gradients: sums in another order round apart more
    assert {r["loss_scale"] for r in records(fsdp) if "loss_scale" in r} == {2.0**16}


@pytest.mark.slow
def test_fsdp_times_tensor_parallel_on_four_ranks(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "2d"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp", parallel__tp=2), timeout=400)
    assert_same_training(run_dir, single)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_in_one_process(tmp_path, corpus_dir, fsdp_run, single):
    run_dir = resumable_copy(fsdp_run, tmp_path / "run", 3)
    proc = in_process("train", *layout_sets(run_dir, corpus_dir, micro=4))
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert_same_training(run_dir, single, steps=range(4, STEPS + 1))


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_fsdp_ranks(tmp_path, corpus_dir, single):
    run_dir = resumable_copy(single, tmp_path / "run", 3)
    proc = train_on(2, layout_sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp"))
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert_same_training(run_dir, single, steps=range(4, STEPS + 1))


@pytest.mark.slow
def test_rank_errors_name_the_rank(tmp_path, corpus_dir):
    sets = layout_sets(tmp_path / "run", corpus_dir, micro=8)  # global 8 is not a multiple of 8 x 2 ranks
    proc = train_on(2, sets, check=False)
    assert proc.returncode != 0
    # Every rank finds the error; the agent stops the others once the first has exited, so which
    # ranks get to say it varies.
    said = re.search(r"kiln \[rank ([01])\]: config error: train.micro_batch_size: 8 does not divide", proc.stderr)
    assert said, proc.stderr[-3000:]
    assert "train.global_batch_size (8 / 2 = 4)" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_two_nodes_meet_at_a_c10d_rendezvous(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "nodes"
    port = free_port()
    node = ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "kiln-test"]
    args = ["launch", *node, "--", "train", *layout_sets(run_dir, corpus_dir, micro=2)]
    agents = [start(*args) for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outs]
    assert_same_training(run_dir, single)


@pytest.mark.slow
def test_elastic_restart_after_a_worker_is_killed(tmp_path, corpus_dir):
    steps = 60
    extra = dict(train__max_steps=steps, checkpoint__every=10, train__log_every=1)

    def sets(run_dir):
        items = tiny_overrides(
            run_dir,
            corpus_dir,
            train__micro_batch_size=2,
            train__global_batch_size=GLOBAL,
            eval__sample_tokens=0,
            **extra,
        )
        return [a for item in items for a in ("--set", item)]

    ref = tmp_path / "uninterrupted"
    train_on(2, sets(ref))
    run_dir = tmp_path / "killed"
    args = ["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2", "--"]
    launcher, ranks = started([*args, "train", *sets(run_dir)], run_dir, steps)
    os.kill(ranks[1], signal.SIGKILL)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-4000:]
    assert "resumed from" in out
    for (name, a), b in zip(weights(run_dir).items(), weights(ref).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_on_every_visible_gpu(tmp_path, corpus_dir, strategy):
    """DDP and FSDP over NCCL, one rank per GPU, against one process on one GPU."""
    n = torch.cuda.device_count()
    global_batch = 8 * n
    common = dict(
        train__global_batch_size=global_batch,
        eval__sample_tokens=0,
        run__device="cuda",
        checkpoint__every=3,
        train__max_steps=STEPS,
    )
    ref = tmp_path / "one"
    kiln(
        "train",
        *[a for i in tiny_overrides(ref, corpus_dir, train__micro_batch_size=8 * n, **common) for a in ("--set", i)],
    )
    run_dir = tmp_path / "all"
    launch(
        n,
        "train",
        *[
            a
            for i in tiny_overrides(
                run_dir, corpus_dir, train__micro_batch_size=8, parallel__strategy=strategy, **common
            )
            for a in ("--set", i)
        ],
    )
    got, want = losses(run_dir), losses(ref)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-3)


@pytest.mark.slow
def test_time_planned_run_agrees_over_ranks(tmp_path, corpus_dir):
    """max_steps=auto on 2 ranks: they probe the same number of steps (a rank stopping on its own
    clock would leave the other in a collective), plan the same run from the slowest costs and
    clock, and correct it alike from the slowest pace and clock."""
    run = tmp_path / "ddp"
    items = tiny_overrides(
        run, corpus_dir, train__max_steps="auto", train__time_budget="5s", eval__sample_tokens=0, checkpoint__every=0
    )
    train_on(2, [a for item in items for a in ("--set", item)])
    planned = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [plan] = [r for r in planned if r.get("event") == "time_plan"]
    final = [r for r in planned if r.get("event") in ("time_plan", "time_replan")][-1]["max_steps"]
    config = (run / "config.toml").read_text()
    assert f"max_steps = {final}" in config and plan["max_steps"] > STEPS
    # Both ranks then trained in step (the run ends at its plan, or on the budget's hard stop).
    assert STEPS < max(losses(run)) <= final


def _initial_weights(tmp_path, corpus_dir, name: str, nproc: int, **layout) -> dict[str, torch.Tensor]:
    """The weights a run starts from under a layout: one step at a learning rate so small that
    AdamW's update rounds away (|update| <= 1e-30 beside weights of 1e-6 and more)."""
    run_dir = tmp_path / name
    once = dict(train__max_steps=1, train__lr=1e-30, checkpoint__every=1)
    items = layout_sets(run_dir, corpus_dir, micro=2, **once, **layout)
    if nproc == 1:
        in_process("train", *items)
    else:
        train_on(nproc, items, timeout=400)
    return weights(run_dir)


@pytest.mark.slow
def test_initial_weights_are_bitwise_the_same_under_every_layout(tmp_path, corpus_dir):
    """Each rank builds the model on ``meta`` and writes only its own shards: the values come
    from the seed and each tensor's name, so every layout starts from the same bits."""
    one = _initial_weights(tmp_path, corpus_dir, "one", 1)
    # One launch for each way to cut the model, on two ranks (FSDP over four cuts every tensor
    # of this model evenly too, by the same code, at twice a launch's start).
    layouts = {
        "fsdp2": (2, {"parallel__strategy": "fsdp"}),
        "tp2": (2, {"parallel__strategy": "fsdp", "parallel__tp": 2}),
        "pp2": (2, {"parallel__strategy": "fsdp", "parallel__pp": 2}),
    }
    for name, (nproc, layout) in layouts.items():
        got = _initial_weights(tmp_path, corpus_dir, name, nproc, **layout)
        assert got.keys() == one.keys()
        for key in one:
            assert torch.equal(got[key], one[key]), f"{name}: {key}"


def test_sequence_parallel_training_rows_are_padded_to_few_widths_within_seq_len():
    """Under sequence parallelism a training batch's rows are padded to buckets of 64 positions
    (DTensor works out each operation's layout once per shape), never past data.seq_len's whole
    shares; in evaluation mode to whole shares only."""
    from torch import nn

    from kiln.distributed.parallel import PaddedRows

    rows = PaddedRows(nn.Linear(1, 1), multiple=4, seq_len=150)
    widths = [rows.width(n, training=True) for n in (1, 63, 64, 65, 129, 150, 151, 200)]
    assert widths == [64, 64, 64, 128, 152, 152, 152, 200]
    assert [rows.width(n, training=False) for n in (1, 63, 64, 65)] == [4, 64, 64, 68]
    assert PaddedRows(nn.Linear(1, 1), multiple=6, seq_len=512).width(5, training=True) == 192  # lcm(64, 6)
