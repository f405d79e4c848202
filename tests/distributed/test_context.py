"""Context parallelism in two gloo processes against the same model in one: the sequence's loss,
its gradients (averaged over the ranks, as data-parallel training does) and its logits."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.distributed.context import apply_cp, local_positions
from kiln.models.gpt.model import GPT, GPTConfig

pytestmark = pytest.mark.dist


def test_each_rank_holds_a_head_chunk_and_the_matching_tail_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([local_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="2 x parallel.cp = 4"):
        local_positions(10, 2, 0)


def _split_sequences(rank: int, init: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        shape = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32)
        cfg = GPTConfig(**shape, tie_embeddings=True)
        whole = GPT(cfg)
        split = copy.deepcopy(whole)
        apply_cp(split, list(split.blocks), "attn.core", init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"])
        idx = torch.randint(0, 64, (3, 16))
        targets = torch.randint(0, 64, (3, 16))
        targets[0, :10] = -100  # rank 0's head chunk and half of rank 1's hold no counted tokens of row 0
        targets[2, 13:] = -100

        want = whole(idx, targets)
        want.backward()
        got = split(idx, targets)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        got.backward()
        for (name, p), q in zip(split.named_parameters(), whole.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / 2, q.grad, rtol=1e-5, atol=1e-7, msg=name)

        with torch.no_grad():
            torch.testing.assert_close(split(idx), whole(idx), rtol=1e-5, atol=1e-6)
            # Decoding over a kv cache is not split: every rank runs the whole sequence.
            cache = split.new_kv_cache(3, 16)
            torch.testing.assert_close(split(idx, kv_cache=cache), whole(idx), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_sequence_split_over_two_ranks_has_one_process_loss_gradients_and_logits(tmp_path):
    mp.spawn(_split_sequences, args=(str(tmp_path / "init"),), nprocs=2, join=True)
