import gc
import itertools
import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from kiln.data.corpus import DataError
from kiln.data.loader import StepSampler, TokenSequences, make_train_loader, val_batches


def token_file(tmp_path, n, dtype=np.uint16):
    path = tmp_path / "tokens.bin"
    np.arange(n, dtype=dtype).tofile(path)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def take(sampler, n):
    """The first n indices of a sampler's stream of step batches, flattened."""
    return list(itertools.islice(itertools.chain.from_iterable(sampler), n))


def test_token_sequences_shift_and_length(tmp_path):
    ds = TokenSequences(token_file(tmp_path, 41), seq_len=8)
    assert len(ds) == 5  # (41 - 1) // 8: the last window needs one extra token for its target
    x, y = ds[4]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == list(range(32, 40)) and y.tolist() == list(range(33, 41))
    assert len(TokenSequences(token_file(tmp_path, 40), seq_len=8)) == 4
    with pytest.raises(IndexError):
        ds[5]


def test_token_sequences_pickle_without_the_array(tmp_path):
    ds = TokenSequences(token_file(tmp_path, 100_001, np.uint32), seq_len=10)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert [t.tolist() for t in clone[7]] == [t.tolist() for t in ds[7]]


def test_sampler_is_a_function_of_seed_and_step():
    a = take(StepSampler(50, 8, seed=3), 200)
    assert a == take(StepSampler(50, 8, seed=3), 200)
    assert a != take(StepSampler(50, 8, seed=4), 200)
    for k in (1, 6, 7, 13):  # within the first epoch, at its boundary, and later
        assert take(StepSampler(50, 8, seed=3, start_step=k), 200 - 8 * k) == a[8 * k :]


def test_sampler_covers_each_epoch_once():
    stream = take(StepSampler(37, 4, seed=0), 37 * 3)
    epochs = [stream[i * 37 : (i + 1) * 37] for i in range(3)]
    assert all(sorted(e) == list(range(37)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_ranks_partition_each_global_batch():
    whole = take(StepSampler(30, 12, seed=5, start_step=2), 12 * 6)
    ranks = [take(StepSampler(30, 12, seed=5, start_step=2, rank=r, world_size=3), 4 * 6) for r in range(3)]
    for step in range(6):
        shares = [r[step * 4 : (step + 1) * 4] for r in ranks]
        assert sum(shares, []) == whole[step * 12 : (step + 1) * 12]
    with pytest.raises(ValueError, match="not divisible by world_size"):
        StepSampler(30, 10, seed=0, world_size=3)


def test_loader_workers_match_in_process(tmp_path):
    ds = TokenSequences(token_file(tmp_path, 2000), seq_len=16)
    kw = dict(schedule=8, seed=1, start_step=3, pin_memory=False)
    expected = list(itertools.islice(make_train_loader(ds, num_workers=0, **kw), 10))
    got = list(itertools.islice(make_train_loader(ds, num_workers=2, **kw), 10))
    assert expected[0][0].shape == (8, 16)  # one step's batch; the loop cuts it into micro-batches
    for (x0, y0), (x1, y1) in zip(expected, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_sampler_follows_a_batch_ramp():
    from kiln.data.batch_schedule import BatchSchedule

    ramp = BatchSchedule(8, [(2, 3), (4, 2)])  # 3 steps of 2, 2 steps of 4, then 8
    sizes = [len(b) for b in itertools.islice(iter(StepSampler(50, ramp, seed=2)), 8)]
    assert sizes == [2, 2, 2, 4, 4, 8, 8, 8]
    assert [ramp.samples_before(s) for s in range(8)] == [0, 2, 4, 6, 10, 14, 22, 30]
    whole = take(StepSampler(50, ramp, seed=2), 60)
    for k in range(8):  # starting anywhere, even mid-ramp, continues the same stream
        assert (
            take(StepSampler(50, ramp, seed=2, start_step=k), 60 - ramp.samples_before(k))
            == whole[ramp.samples_before(k) :]
        )
    shares = [next(iter(StepSampler(50, ramp, seed=2, start_step=3, rank=r, world_size=2))) for r in range(2)]
    assert shares[0] + shares[1] == whole[6:10]
    with pytest.raises(ValueError, match="not divisible by world_size"):
        StepSampler(50, BatchSchedule(8, [(3, 1)]), seed=0, world_size=2)


def test_each_batch_serves_repeat_steps_and_a_resume_at_any_step_goes_on_alike():
    """``repeat`` (GRPO's grpo.iterations): each step-batch is read for that many steps in a row,
    no sequence skipped; started at any step, within a cycle too, the stream is the same."""
    from torch.utils.data import TensorDataset

    from kiln.data.batch_schedule import BatchSchedule
    from kiln.data.loader import StepBatches

    plain = list(itertools.islice(iter(StepSampler(50, 6, seed=3)), 5))
    repeated = list(itertools.islice(iter(StepSampler(50, 6, seed=3, repeat=3)), 15))
    assert repeated == [b for b in plain for _ in range(3)]
    for k in range(15):
        assert list(itertools.islice(iter(StepSampler(50, 6, seed=3, start_step=k, repeat=3)), 15 - k)) == repeated[k:]
    shares = [next(iter(StepSampler(50, 6, seed=3, start_step=4, rank=r, world_size=2, repeat=3))) for r in range(2)]
    assert shares[0] + shares[1] == repeated[4]
    batches = StepBatches(
        TensorDataset(torch.arange(50)), BatchSchedule(6), 3, num_workers=0, pin_memory=False, repeat=3
    )
    assert [batches.items(step) for step in range(1, 16)] == repeated  # steps are 1-based
    assert next(batches.loader(4))[0].tolist() == repeated[4]
    assert [batches.positions(step) for step in (1, 3, 4, 7)] == [[0, 6], [0, 6], [6, 12], [12, 18]]
    assert [batches.position(done)["samples_seen"] for done in (0, 1, 3, 4, 6, 7)] == [0, 6, 6, 12, 12, 18]


def test_val_batches_are_fixed_and_spread(tmp_path):
    ds = TokenSequences(token_file(tmp_path, 1001), seq_len=10)  # 100 sequences
    batches = val_batches(ds, micro_batch_size=4, num_batches=5)
    assert len(batches) == 5 and all(x.shape == (4, 10) for x, _ in batches)
    firsts = [int(x[0]) // 10 for xb, _ in batches for x in xb]
    assert firsts == [i * 5 for i in range(20)]
    again = val_batches(ds, micro_batch_size=4, num_batches=5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True))

    small = val_batches(TokenSequences(token_file(tmp_path, 61), seq_len=10), micro_batch_size=4, num_batches=5)
    assert [len(x) for x, _ in small] == [4, 2]
    with pytest.raises(DataError, match="validation split has 5 tokens"):
        val_batches(TokenSequences(token_file(tmp_path, 5), seq_len=10), 4, 5)


class _Watched:
    """Writes the pid of the process that frees it (a CUDA tensor freed in a forked worker aborts it)."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_workers_never_free_the_parents_garbage(tmp_path):
    gc.disable()  # the cycle stays uncollected in the parent until the loader has forked
    try:
        _Watched(tmp_path / "freed")  # unreachable at once: garbage only a collection frees
        ds = TokenSequences(np.arange(10_000, dtype=np.uint16), 16)

        def collecting(rows):  # runs in the workers
            gc.collect()
            return default_collate(rows)

        loader = make_train_loader(
            ds, schedule=8, seed=0, start_step=0, num_workers=2, pin_memory=False, collate_fn=collecting
        )
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        del batches
    finally:
        gc.enable()
    gc.collect()
    assert (tmp_path / "freed").read_text().split() == [str(os.getpid())]
