"""Decoding on two ranks (gloo processes) against one process. Tensor-parallel ranks: sequence
parallelism splits each forward's positions evenly over the ranks, so the decoder pads each row's
in front (a decode step feeds two positions a row, one of them real). Pipeline stages: each step
runs the stages in turn, each rank's layers storing their keys and values in its own cache, and
the last stage's logits are broadcast. Context-parallel ranks decode whole rows each (beside
tensor-parallel ranks, padded to whole shares of positions as on those alone). The rows' tokens
are those one process decodes."""

import copy

import pytest
import torch
import torch.distributed as dist

from kiln.config import ModelConfig, ParallelConfig
from kiln.distributed.parallelize import parallelize
from kiln.distributed.world import World, build_mesh, mesh_dims
from kiln.models import GPT, GPTConfig, get_family
from kiln.models.decode import Decoder, Row, Sampling

from kilnrun import spawn

pytestmark = pytest.mark.dist


def _rows() -> list[Row]:
    """Greedy and sampled rows, prompts of 1 to 29 tokens, the longest decoded past the context
    (32 positions: the cache's ring wraps)."""
    generator = torch.Generator().manual_seed(1)
    lengths, new = [3, 17, 1, 29, 8], [20, 5, 25, 12, 9]
    return [
        Row(
            torch.randint(0, 64, (n,), generator=generator).tolist(),
            m,
            Sampling(temperature=0.0) if i % 2 else Sampling(temperature=1.0, top_k=20, seed=i),
        )
        for i, (n, m) in enumerate(zip(lengths, new, strict=True))
    ]


def _decode_on_tensor_parallel_ranks(rank: int, init: str, cp: int) -> None:
    """Two tensor-parallel ranks, or two pairs of them splitting sequences over two
    context-parallel ranks (each pair decodes whole rows, in passes padded to whole shares)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2 * cp)
    try:
        torch.manual_seed(0)
        shape = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32)
        config = GPTConfig(**shape, tie_embeddings=False)
        whole = GPT(config).double()  # no near-tie of an argmax can flip between the two
        family = get_family("gpt")
        alone = _rows()
        Decoder(family.decoding(whole), max_batch=3, max_batch_tokens=8).run(alone)

        pcfg = ParallelConfig(tp=2, cp=cp, strategy="fsdp" if cp > 1 else "ddp")
        world = World(rank=rank, size=2 * cp, tp=2, cp=cp, mesh=build_mesh("cpu", mesh_dims(2 * cp, pcfg)))
        split = parallelize(copy.deepcopy(whole), family.parallel_plan(config), world, pcfg).eval_forward
        fed: list[int] = []
        split.register_forward_pre_hook(lambda module, args: fed.append(args[0].size(1)))
        rows = _rows()
        Decoder(family.decoding(split), max_batch=3, max_batch_tokens=8).run(rows)
        assert [r.tokens for r in rows] == [r.tokens for r in alone]
        # Decode steps: one real position a row (context parallelism does not split them).
        assert all(t % 2 == 0 for t in fed) and 2 in fed
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2], ids=["tp", "tp-pairs-over-cp"])
def test_tensor_parallel_ranks_decode_what_one_process_decodes(tmp_path, cp):
    spawn(_decode_on_tensor_parallel_ranks, (str(tmp_path / "init"), cp), 2 * cp)


def _decode_in_pipeline_stages(rank: int, init: str, stages: int, tp: int, cp: int) -> None:
    """kiln's GPT (4 layers) in ``stages`` stages on two pipeline ranks, each of ``tp``
    tensor-parallel ranks (whose forward passes the decoder pads to whole shares of positions),
    or of ``cp`` context-parallel ranks (each decoding whole rows)."""
    size = 2 * tp * cp
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        torch.manual_seed(0)
        shape = dict(vocab_size=64, n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32)
        config = GPTConfig(**shape, tie_embeddings=tp == 1)
        whole = GPT(config).double()
        family = get_family("gpt")
        alone = _rows()
        Decoder(family.decoding(whole), max_batch=3, max_batch_tokens=8).run(alone)

        schedule = "interleaved_1f1b" if stages > 2 else "1f1b"
        pcfg = ParallelConfig(pp=2, tp=tp, cp=cp, pp_virtual_stages=stages // 2, pp_schedule=schedule)
        world = World(rank=rank, size=size, pp=2, tp=tp, cp=cp, mesh=build_mesh("cpu", mesh_dims(size, pcfg)))
        pipeline = parallelize(copy.deepcopy(whole), family.parallel_plan(config), world, pcfg)
        fed: list[int] = []
        pipeline.eval_forward.register_forward_pre_hook(lambda module, args: fed.append(args[0].size(1)))
        rows = _rows()
        decoder = Decoder(family.decoding(pipeline.eval_forward), max_batch=3, max_batch_tokens=8)
        decoder.run(rows)
        assert [r.tokens for r in rows] == [r.tokens for r in alone]
        # Each rank's cache holds its own layers' keys and values only, by their places in the model.
        own = range(world.pp_rank, stages, 2)
        assert sorted(decoder.cache.k) == [i for s in own for i in range(s * 4 // stages, (s + 1) * 4 // stages)]
        assert all(t % tp == 0 for t in fed) and tp in fed  # decode steps: one real position a row
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "stages, tp, cp",
    [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)],
    ids=["a-stage-a-rank", "two-stages-a-rank", "stages-of-tp-pairs", "stages-of-cp-pairs"],
)
def test_pipeline_stages_decode_what_one_process_decodes(tmp_path, stages, tp, cp):
    spawn(_decode_in_pipeline_stages, (str(tmp_path / "init"), stages, tp, cp), 2 * tp * cp)


def _transformers_on_ranks(rank: int, init: str, path: str, pp: int, tp: int, cp: int) -> None:
    """A transformers Llama (2 layers) on ``pp`` stages of ``tp`` tensor-parallel ranks, or split
    over ``cp`` context-parallel ranks (which decode whole rows each). In stages the first one's
    model returns its hidden states, the last takes them as ``inputs_embeds``; each stores its own
    layer's keys and values under the layer's index (transformers' ``layer_idx``)."""
    size = pp * tp * cp
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        family = get_family("hf")
        args = family.resolve(ModelConfig(source=f"hf:{path}", task="causal_lm"), vocab_size=0, seq_len=64)
        whole = family.create(args, "cpu", seed=0).double().eval()
        vocab = args.hf_config().vocab_size
        generator = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 13, 2)]
        alone = [Row(p, 7, Sampling(temperature=0.0)) for p in prompts]
        Decoder(family.decoding(whole), max_batch=2, max_batch_tokens=8).run(alone)

        pcfg = ParallelConfig(pp=pp, tp=tp, cp=cp, strategy="fsdp" if tp > 1 and cp > 1 else "ddp")
        world = World(rank=rank, size=size, pp=pp, tp=tp, cp=cp, mesh=build_mesh("cpu", mesh_dims(size, pcfg)))
        model = parallelize(copy.deepcopy(whole), family.parallel_plan(args), world, pcfg)
        rows = [Row(p, 7, Sampling(temperature=0.0)) for p in prompts]
        decoder = Decoder(family.decoding(model.eval_forward), max_batch=2, max_batch_tokens=8)
        decoder.run(rows)
        assert [r.tokens for r in rows] == [r.tokens for r in alone]
        assert sorted(decoder.cache.k) == ([world.pp_rank] if pp > 1 else [0, 1])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "pp, tp, cp",
    [(2, 1, 1), (2, 2, 1), (1, 1, 2), (1, 2, 2), (2, 1, 2)],
    ids=["stages", "stages-of-tp-pairs", "context-parallel", "tp-pairs-over-cp", "stages-of-cp-pairs"],
)
def test_transformers_on_ranks_decode_what_one_process_decodes(tmp_path, hf_llama, pp, tp, cp):
    spawn(_transformers_on_ranks, (str(tmp_path / "init"), str(hf_llama), pp, tp, cp), pp * tp * cp)
