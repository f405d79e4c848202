"""A second, deliberately different family (tests/toy_family.py: a causal MLP-mixer) goes through
the same code as kiln's GPT, with nothing in kiln.distributed, kiln.plan or the Trainer written
for it: it trains, is planned, checkpoints and resumes exactly, and runs tensor-parallel."""

import json

import pytest
import torch

from kiln.cli import main
from kiln.config import ConfigError, ParallelConfig, load_config
from kiln.distributed.parallelize import check_layout, parallelize
from kiln.distributed.world import World
from kiln.models import build_model, get_family
from kiln.plan import make_plan, model_state
from kiln.train.optim import build_optimizer
from kiln.train.precision import Precision
from kiln.train.run import load_run
from kiln.train.step import TrainStep

from conftest import tiny_overrides
from kilnrun import in_process, launch, losses
from memtrack import peak_memory

pytestmark = pytest.mark.e2e

TOY = "model.family=toy_family:FAMILY"


def _sets(run_dir, corpus, **extra):
    items = [TOY, *tiny_overrides(run_dir, corpus, eval__sample_tokens=0, **extra)]
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, corpus_dir):
    run_dir = tmp_path_factory.mktemp("toy") / "single"
    in_process("train", *_sets(run_dir, corpus_dir))
    return run_dir


def test_it_trains_and_resumes_exactly(tmp_path, corpus_dir, toy_run):
    single = toy_run
    trained = losses(single)
    assert list(trained) == list(range(1, 13)) and trained[12] < trained[1] - 0.5
    assert "toy_family:FAMILY" in (single / "config.toml").read_text()
    assert json.loads((single / "model.json").read_text())["d_ff"] == 128
    assert not (single / "samples.txt").exists()  # the family cannot sample: no samples, no error
    # Resume from the uninterrupted run's step-8 checkpoint in a new run directory.
    resumed = tmp_path / "resumed"
    in_process("train", *_sets(resumed, corpus_dir), "--resume", single / "checkpoints" / "step-00000008")
    got = losses(resumed)
    assert list(got) == [9, 10, 11, 12] and all(got[s] == trained[s] for s in got)
    a, b = (
        load_run(single, device="cpu", trust=True).model.state_dict(),
        load_run(resumed, device="cpu", trust=True).model.state_dict(),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ev = json.loads(
        in_process("eval", single, "--trust-checkpoint").stdout
    )  # the family's evaluation, from the run directory alone
    assert ev["step"] == 12 and ev["val_loss"] > 0


@pytest.mark.slow
@pytest.mark.dist
def test_tensor_parallel_on_two_ranks_equals_one_process(tmp_path, corpus_dir, toy_run):
    single = toy_run
    run_dir = tmp_path / "tp"
    launch(2, "train", *_sets(run_dir, corpus_dir, parallel__tp=2))
    got, want = losses(run_dir), losses(single)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    state = run_dir / "checkpoints" / "step-00000012" / "state"  # sharded: DCP, one file per rank
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    a, b = (
        load_run(run_dir, device="cpu", trust=True).model.state_dict(),
        load_run(single, device="cpu", trust=True).model.state_dict(),
    )
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)


def test_tensor_parallel_degree_is_checked_against_the_family_plan():
    family = get_family("toy_family:FAMILY")
    args = family.resolve(load_config(None, ["model.d_ff=127"]).model, vocab_size=512, seq_len=32)
    layout = ParallelConfig(tp=2, strategy="fsdp")
    with pytest.raises(ConfigError, match=r"parallel.tp: 2 must divide model.d_ff=127"):
        check_layout(family.parallel_plan(args), World(size=2, tp=2), layout, "MixerLM")


def _measured_peak(cfg) -> int:
    """Peak live tensor bytes over two steps of the Trainer's step, the model built inside."""
    family = get_family(cfg.model.family)

    def two_steps():
        args = family.resolve(cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
        # Built eagerly: materialising from the meta device swaps tensors, which fake ones cannot be.
        model = parallelize(family.build(args), family.parallel_plan(args), World(), cfg.parallel)
        step = TrainStep(
            model,
            family.loss,
            build_optimizer(model, cfg.train, torch.device("cpu")),
            Precision("fp32", torch.device("cpu")),
            grad_clip=1.0,
        )
        if cfg.train.activation_checkpointing:
            step.recompute_activations()
        rows, micro = cfg.train.global_batch_size, cfg.train.micro_batch_size
        for _ in range(2):
            x, y = (torch.randint(0, cfg.data.vocab_size, (rows, cfg.data.seq_len)) for _ in range(2))
            step.forward_backward([(x[i : i + micro], y[i : i + micro]) for i in range(0, rows, micro)], 1)
            step.update(1e-3)

    return peak_memory(two_steps)


@pytest.mark.parametrize(
    "sets",
    [
        ["train.micro_batch_size=4", "train.global_batch_size=8"],
        ["train.micro_batch_size=8", "train.global_batch_size=8", "train.activation_checkpointing=true"],
        [
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "model.d_model=256",
            "model.d_ff=1024",
            "model.n_layer=4",
            "data.vocab_size=2048",
        ],
    ],
)
def test_plan_counts_its_state_exactly_and_its_peak_within_15_percent(sets):
    cfg = load_config(None, [TOY, "data.seq_len=64", "data.vocab_size=512", *sets])
    plan = make_plan(cfg, device_memory="8GiB")
    family = get_family(cfg.model.family)
    args = family.resolve(cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
    model = build_model(family, args, "cpu", 0)
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    optimizer.step()
    planned = model_state(plan.job.shape, plan.base)
    params = list(model.parameters())
    assert planned["parameters"] == planned["gradients"] == sum(p.numel() * 4 for p in params)
    assert planned["optimizer_state"] == sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
    )
    measured = _measured_peak(cfg)
    assert abs(plan.memory.allocated - measured) <= 0.15 * measured, (plan.memory.allocated, measured)


def test_plan_command_takes_the_family(capsys):
    assert (
        main(
            [
                "plan",
                "--set",
                TOY,
                "--set",
                "parallel.tp=2",
                "--world-size",
                "2",
                "--set",
                "parallel.strategy=fsdp",
                "--device-memory",
                "8GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model buffers (causal masks)" in out and "fits" in out
