"""train.optimizer=muon: Muon for the hidden matrices, AdamW for the rest, one optimizer: the
same training on DDP and FSDP ranks as in one process, a bitwise resume, and a skipped step that
changes nothing."""

from __future__ import annotations

import pytest
import torch

from kiln.config import TrainConfig
from kiln.models import GPT, GPTConfig
from kiln.train.optim import Muon, build_optimizer, orthogonalize
from kiln.train.precision import step_unless

from kilnrun import in_process, losses, spawn
from layouts import assert_same_training, layout_sets, resumable_copy, train_on, weights

MUON = ("train.optimizer", "muon")


def muon_sets(run_dir, corpus_dir, micro, **extra):
    return layout_sets(run_dir, corpus_dir, micro=micro, train__optimizer="muon", train__muon_lr=0.02, **extra)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus_dir):
    run_dir = tmp_path_factory.mktemp("muon") / "run"
    in_process("train", *muon_sets(run_dir, corpus_dir, micro=4))
    return run_dir


def test_the_hidden_matrices_and_only_they_get_muon():
    model = GPT(
        GPTConfig(
            vocab_size=96, max_seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, tie_embeddings=False
        )
    )
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02), torch.device("cpu"))
    assert isinstance(opt, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    assert muon and all(".w" in n for n in muon) and not any("emb" in n or "head" in n or "norm" in n for n in muon)
    [group] = [g for g in opt.param_groups if g["muon"]]
    assert group["lr"] * group["lr_scale"] == pytest.approx(0.02) and group["weight_decay"] == 0.1


def test_orthogonalize_gives_singular_values_near_one():
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic iteration's band around 1


def test_a_skipped_step_changes_nothing():
    model = GPT(
        GPTConfig(
            vocab_size=96, max_seq_len=16, n_layer=1, d_model=32, n_head=4, n_kv_head=2, d_ff=64, tie_embeddings=False
        )
    )
    opt = build_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    x = torch.randint(0, 96, (2, 16))
    model(x, x).backward()
    opt.step()  # state exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    model(x, x).backward()
    step_unless(opt, found_inf=torch.tensor(1.0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(state[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items())


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel__strategy": "ddp"},
        {"parallel__strategy": "fsdp"},
        {"parallel__tp": 2},
        {"parallel__strategy": "fsdp", "parallel__dp_replicate": 2},
    ],
    ids=["ddp", "fsdp", "tp", "hsdp"],
)
def test_muon_on_two_ranks_trains_as_one_process(tmp_path, corpus_dir, one_process, layout):
    """DDP replicas, FSDP shards and tensor-parallel halves (each update matrix orthogonalised by
    one rank of its shards' group), and HSDP's two replicas of two shards (4 ranks)."""
    run_dir = tmp_path / "run"
    micro = 4 if "parallel__tp" in layout else 2  # tensor-parallel ranks read the same batch
    train_on(4 if "parallel__dp_replicate" in layout else 2, muon_sets(run_dir, corpus_dir, micro=micro, **layout))
    assert_same_training(run_dir, one_process)


def test_resume_is_bitwise(tmp_path, corpus_dir, one_process):
    copy = resumable_copy(one_process, tmp_path / "resumed", step=3)
    in_process("train", *muon_sets(copy, corpus_dir, micro=4))
    assert losses(copy) == losses(one_process)
    got, want = weights(copy), weights(one_process)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _spread(rank: int, init: str, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from kiln.train.optim import orthogonalize, orthogonalize_all

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        # Five matrices over three ranks (two rounds), of rows and columns the ranks split
        # unevenly (7 rows: 3, 3, 1; 2 rows: 1, 1 and none), wide and tall, by rows or columns.
        shapes = [((7, 5), 0), ((4, 9), 1), ((2, 6), 0), ((10, 3), 1), ((6, 6), 0)]
        wholes = [torch.randn(shape) for shape, _ in shapes]
        sharded = [distribute_tensor(w, mesh, [Shard(d)]) for w, (_, d) in zip(wholes, shapes, strict=True)]
        plain = torch.randn(4, 4)
        calls = []
        import kiln.train.optim as optim

        inner = optim.orthogonalize
        optim.orthogonalize = lambda u, *a, **k: calls.append(tuple(u.shape)) or inner(u, *a, **k)
        try:
            got = orthogonalize_all([*sharded, plain])
        finally:
            optim.orthogonalize = inner
        for g, w, d in zip(got[:-1], wholes, sharded, strict=True):
            torch.testing.assert_close(g.full_tensor(), orthogonalize(w), rtol=1e-5, atol=1e-6)
            assert g.placements == d.placements
        torch.testing.assert_close(got[-1], orthogonalize(plain))
        # Rank r orthogonalised matrices r and r + 3 only (and the plain one): a third of the work.
        owned = [tuple(s if d == 0 else s[::-1]) for (s, d) in shapes[rank::world]]
        assert calls == [(4, 4), *owned], calls
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_each_sharded_matrix_is_orthogonalised_once_by_its_owner_rank(tmp_path):

    spawn(_spread, (str(tmp_path / "init"), 3), 3)
