"""Context parallelism in two gloo processes against the same model in one: the sequence's loss,
its gradients (averaged over the ranks, as data-parallel training does) and its logits."""

import copy

import pytest
import torch
import torch.distributed as dist

from kiln.distributed.context import apply_cp, local_positions
from kiln.models.decode import SlotCache
from kiln.models.gpt.model import GPT, GPTConfig

from kilnrun import spawn

pytestmark = pytest.mark.dist


def test_each_rank_holds_a_head_chunk_and_the_matching_tail_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([local_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="2 x parallel.cp = 4"):
        local_positions(10, 2, 0)


def _whole_and_split() -> tuple[GPT, GPT]:
    """A tiny GPT, and a copy of it splitting its sequences over the two ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    shape = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32)
    whole = GPT(GPTConfig(**shape, tie_embeddings=True))
    split = copy.deepcopy(whole)
    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
    apply_cp(list(split.blocks), "attn.core", cp_mesh).install(split)
    return whole, split


def _assert_same_loss_and_gradients(whole: GPT, split: GPT, *args, **kwargs) -> None:
    """The split model's loss is the whole one's, and its gradients averaged over the ranks (as
    data-parallel training averages them) too."""
    want = whole(*args, **kwargs)
    want.backward()
    got = split(*args, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    got.backward()
    for (name, p), q in zip(split.named_parameters(), whole.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / 2, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def _split_sequences(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        whole, split = _whole_and_split()
        idx = torch.randint(0, 64, (3, 16))
        targets = torch.randint(0, 64, (3, 16))
        targets[0, :10] = -100  # rank 0's head chunk and half of rank 1's hold no counted tokens of row 0
        targets[2, 13:] = -100
        _assert_same_loss_and_gradients(whole, split, idx, targets)

        with torch.no_grad():
            torch.testing.assert_close(split(idx), whole(idx), rtol=1e-5, atol=1e-6)
            # Decoding over a kv cache is not split: every rank runs the whole sequence.
            cache = SlotCache(3, 16, idx.device)
            cache.bind(slice(0, 3), torch.arange(16).expand(3, -1), [15] * 3)
            torch.testing.assert_close(split(idx, kv_cache=cache), whole(idx), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_sequence_split_over_two_ranks_has_one_process_loss_gradients_and_logits(tmp_path):
    spawn(_split_sequences, (str(tmp_path / "init"),), 2)


def _split_documents(rank: int, init: str) -> None:
    """Rows packing documents (positions that restart), split over two ranks: the loss, gradients
    and logits of one process, and a token's logits blind to its row's other documents."""
    from kiln.data.loader import document_positions

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        whole, split = _whole_and_split()
        idx = torch.randint(1, 64, (2, 16))
        idx[0, [2, 9]] = 0  # ends of text: row 0 packs three documents, across both ranks' chunks
        idx[1, 5] = 0
        positions = torch.stack([document_positions(row == 0) for row in idx])
        targets = torch.randint(0, 64, (2, 16)).masked_fill(idx == 0, -100)
        _assert_same_loss_and_gradients(whole, split, idx, targets, positions=positions)
        with torch.no_grad():
            logits = split(idx, positions=positions)
            torch.testing.assert_close(logits, whole(idx, positions=positions), rtol=1e-5, atol=1e-6)
            other = idx.clone()
            other[0, :2] = torch.tensor([7, 8])  # row 0's first document changes
            changed = split(other, positions=positions)
            torch.testing.assert_close(changed[0, 3:], logits[0, 3:], rtol=0, atol=1e-5)
            assert (changed[0, :2] - logits[0, :2]).abs().max() > 1e-4
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_packed_documents_split_over_two_ranks_attend_within_themselves_as_in_one_process(tmp_path):
    spawn(_split_documents, (str(tmp_path / "init"),), 2)
