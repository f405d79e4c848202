"""One DeviceMesh over named dimensions (pp, dp_replicate, dp_shard, cp, tp; ep a view of the
data-parallel ranks): its shapes for each layout, the ranks of each group read from it, and HSDP
(FSDP within replicas) training as one process does."""

import os

import pytest

from kiln.config import ParallelConfig
from kiln.distributed.world import mesh_dims

from kilnrun import spawn
from layouts import assert_same_training, layout_sets, train_on

pytestmark = pytest.mark.dist


def test_the_mesh_of_each_layout():
    assert mesh_dims(8, ParallelConfig(tp=2)) == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2)
    hsdp = ParallelConfig(strategy="fsdp", dp_replicate=2, cp=2)
    assert mesh_dims(8, hsdp) == dict(pp=1, dp_replicate=2, dp_shard=2, cp=2, tp=1)
    # Expert parallelism cuts the shards in two: the experts are split over dp_shard_in x cp.
    experts = ParallelConfig(strategy="fsdp", ep=4, cp=2)
    assert mesh_dims(16, experts) == dict(pp=1, dp_replicate=1, dp_shard_out=4, dp_shard_in=2, cp=2, tp=1)
    assert mesh_dims(8, ParallelConfig(pp=2, ep=2)) == dict(
        pp=2, dp_replicate=1, dp_shard_out=2, dp_shard_in=2, cp=1, tp=1
    )
    # A degree that does not divide is left at 1 here: parallelize refuses it, naming the key.
    assert mesh_dims(6, ParallelConfig(cp=4))["cp"] == 1
    assert mesh_dims(6, ParallelConfig(strategy="fsdp", dp_replicate=4))["dp_replicate"] == 1


def _groups(rank: int, size: int, init: str) -> None:
    import torch
    import torch.distributed as dist

    from kiln.distributed.world import World, build_mesh

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:

        def ranks(mesh, name):
            return dist.get_process_group_ranks(mesh[name].get_group())

        # pp 2 x dp 2: the pipeline's ends hold the two copies of a tied weight.
        mesh = build_mesh("cpu", mesh_dims(4, ParallelConfig(pp=2)))
        world = World(rank=rank, size=4, pp=2, mesh=mesh)
        assert world.pipeline_ends() == [(0, 2), (1, 3)]
        assert ranks(mesh, "pp") == [rank % 2, rank % 2 + 2] and ranks(mesh, "dp") == [rank // 2 * 2, rank // 2 * 2 + 1]
        # HSDP 2 x 2: shards within a replica, replicas across.
        mesh = build_mesh("cpu", mesh_dims(4, ParallelConfig(strategy="fsdp", dp_replicate=2)))
        world = World(rank=rank, size=4, dp_replicate=2, mesh=mesh)
        fsdp = world.fsdp_mesh()
        assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(fsdp.shape) == (2, 2)
        assert ranks(mesh, "dp_shard_cp") == ([0, 1] if rank < 2 else [2, 3]) and ranks(mesh, "dp") == [0, 1, 2, 3]
        # Context x expert parallelism: the experts' ranks are the context-parallel ones and the
        # next shard's; the experts' FSDP runs over the rest.
        mesh = build_mesh("cpu", mesh_dims(4, ParallelConfig(strategy="fsdp", cp=2, ep=2)))
        assert ranks(mesh, "ep") == ranks(mesh, "cp") == ([0, 1] if rank < 2 else [2, 3])
        assert ranks(mesh, "ep_shard") == [rank % 2, rank % 2 + 2]
        assert torch.equal(mesh.mesh.flatten(), torch.arange(4))
    finally:
        dist.destroy_process_group()


def test_every_group_is_a_view_of_the_one_mesh(tmp_path):
    """Built from the mesh's own flattening (DeviceMesh._flatten, private: this fails if it changes).
    The ranks meet through a file, not a port picked beforehand (another test's process could take
    it in between)."""
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    spawn(_groups, (4, str(tmp_path / "init")), 4)


@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_equal_one_process(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "hsdp"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp", parallel__dp_replicate=2))
    assert_same_training(run_dir, single)
