"""The token exchange of expert parallelism: one private PyTorch collective, checked here."""

import pytest
import torch
import torch.distributed as dist

from kiln.distributed.experts import exchange

from kilnrun import spawn

pytestmark = pytest.mark.dist


def _exchange(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        x = (torch.arange(5.0) + 10 * rank).unsqueeze(1).repeat(1, 2).requires_grad_()
        sends = [2, 3] if rank == 0 else [1, 4]  # rows to rank 0, rows to rank 1
        takes = [2, 1] if rank == 0 else [3, 4]
        got = exchange(x, takes, sends, dist.group.WORLD)
        want = [0.0, 1.0, 10.0] if rank == 0 else [2.0, 3.0, 4.0, 11.0, 12.0, 13.0, 14.0]
        assert got[:, 0].tolist() == want
        (got * (rank + 1)).sum().backward()
        # Each row's gradient comes back from the rank it went to.
        expected = [1.0, 1.0, 2.0, 2.0, 2.0] if rank == 0 else [1.0, 2.0, 2.0, 2.0, 2.0]
        assert x.grad is not None and x.grad[:, 0].tolist() == expected
        # Neither rank tears gloo down while the other still exchanges with it (a full .ci/run saw
        # one rank abort in teardown: "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rows_go_to_their_ranks_and_their_gradients_come_back(tmp_path):
    spawn(_exchange, (str(tmp_path / "init"),), 2)
