"""Pipeline parallelism: the model's repeated layers cut into consecutive stages along the "pp"
dimension of the world's mesh, run by a ``torch.distributed.pipelining`` schedule.

The model stays plain. Its family's plan names the repeated layers and the modules that go with
the first stage (the embedding) and with the last (final norm, output layer); a stage is the
model with every other layer and module removed. The layers keep their numbers, so parameter
names are those of the whole model and a checkpoint of any layout loads into any other. Stage
``s`` of ``pp * v`` lives on pipeline rank ``s % pp`` (with ``v`` virtual stages per rank, the
interleaved schedule's "loop" placement), and each rank's stages share one module that holds
all of its layers: the optimizer, clipping and checkpoints see that one module.

Each micro-batch of the training loop is one pipeline step: the schedule cuts it into
``parallel.pp_microbatches`` pieces, and the last stage weighs each piece's loss by its share of
the step's loss tokens, so the gradients are those of the whole batch, accumulation or not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kiln.checkpoint.store import StoredWeights
from kiln.config import ConfigError, ParallelConfig
from kiln.data.batch import TextBatch, TokenBatch, next_labels
from kiln.distributed.context import SequenceSplit
from kiln.distributed.parallel import (
    ParallelModel,
    Staged,
    StepCompute,
    clip_grad_norm_,
    load_whole,
    materialize,
    shard,
)
from kiln.distributed.world import World
from kiln.labels import IGNORE_INDEX
from kiln.models.decode import POSITIONS_MULTIPLE
from kiln.models.family import ParallelPlan
from kiln.models.init import Values

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


def stage_layers(n_layers: int, stages: int, counts: tuple[int, ...] = ()) -> list[range]:
    """The repeated layers of each stage: consecutive runs, of ``counts`` layers (one count per
    stage, parallel.pp_layers) or equal."""
    if counts:
        if sum(counts) != n_layers:
            raise ConfigError(
                [f"parallel.pp_layers: {list(counts)} add up to {sum(counts)} layers; the model has {n_layers}"]
            )
        ends = [sum(counts[: s + 1]) for s in range(stages)]
        return [range(end - count, end) for end, count in zip(ends, counts, strict=True)]
    if n_layers % stages:
        raise ConfigError(
            [
                f"parallel.pp: the model's {n_layers} layers do not split into {stages} equal pipeline stages "
                "(parallel.pp x parallel.pp_virtual_stages); choose a divisor of the layer count, or give "
                "each stage's layers (parallel.pp_layers)"
            ]
        )
    size = n_layers // stages
    return [range(s * size, (s + 1) * size) for s in range(stages)]


class StageLayers(nn.ModuleDict):
    """A stage's repeated layers, keyed by their numbers in the whole model; sliced or iterated
    like the ``nn.ModuleList`` they came from (``transformers``' decoders run
    ``self.layers[: n]``), in order."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return list(self.values())[key]
        return super().__getitem__(key)


def _set(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def _keep(model: nn.Module, plan: ParallelPlan, layers: Iterable[int], first: bool, last: bool) -> None:
    """Make ``model`` hold only ``layers`` of its repeated layers, under their numbers in the whole
    model (``StageLayers``, so that parameter names and checkpoints are the whole model's), with
    the first stage's modules if ``first`` and the last's if ``last`` (the others set to None, or
    an identity where the plan says so), in place."""
    container, first_paths, last_paths = plan.pipeline_paths(model)
    kept, whole = set(layers), model.get_submodule(container)
    _set(model, container, StageLayers({n: layer for n, layer in whole.named_children() if int(n) in kept}))
    for path in () if first else first_paths.values():
        _set(model, path, None)
    for end, path in () if last else last_paths.items():
        _set(model, path, nn.Identity() if end in plan.pipeline_identity else None)


def _cut(module: nn.Module, plan: ParallelPlan, layers: Iterable[int], first: bool, last: bool) -> nn.Module:
    """A module of ``module``'s class that shares its submodules and tensors but holds only
    ``layers`` of its repeated layers (and the first or last stage's modules: ``_keep``), so that
    what the layout does to its layers (FSDP, initial values) it does to ``module``'s, and
    ``module`` itself stays whole (its initial values are read from it). A deep copy that copies
    only ``module``, the modules on the way to what it cuts and its container of layers (the
    rest given to ``copy.deepcopy`` as already copied)."""
    container, first_paths, last_paths = plan.pipeline_paths(module)
    on_the_way = {""}
    for path in (container, *first_paths.values(), *last_paths.values()):
        parts = path.split(".")
        on_the_way.update(".".join(parts[:i]) for i in range(1, len(parts)))
    copied = {id(module.get_submodule(path)) for path in (*on_the_way, container)}
    shared: dict[int, object] = {id(m): m for m in module.modules() if id(m) not in copied}
    shared.update({id(t): t for t in [*module.parameters(), *module.buffers()]})
    cut = copy.deepcopy(module, shared)
    _keep(cut, plan, layers, first, last)
    return cut


def _share_own_tensors(stage: nn.Module, part: nn.Module) -> None:
    """Give ``stage`` (a ``_cut`` of ``part``) the tensors ``part`` itself holds now: the stages
    share ``part``'s submodules, but not the tensors ``part`` holds directly (its buffers), which
    allocating it replaced."""
    if stage is part:
        return
    for name, tensor in [*part.named_parameters(recurse=False), *part.named_buffers(recurse=False)]:
        setattr(stage, name, tensor)


def _tied(model: nn.Module, plan: ParallelPlan) -> dict[str, str]:
    """The weights the first and the last stage share (tied input and output embeddings): each
    one's name among the first stage's parameters and among the last's."""

    def named(names: Iterable[str]) -> dict[int, str]:
        return {id(p): f"{name}.{key}" for name in names for key, p in model.get_submodule(name).named_parameters()}

    _, first_paths, last_paths = plan.pipeline_paths(model)
    first, last = named(first_paths.values()), named(last_paths.values())
    return {first[key]: last[key] for key in first.keys() & last.keys()}


class PipelineModel(ParallelModel):
    """This rank's share of a pipelined model: its layers as one module (``module``, with tensor
    parallelism and FSDP applied), the stages cut from it and the schedule that runs them.

    ``forward_backward`` runs one micro-batch through the pipeline with gradients;
    ``eval_forward(inputs, targets)`` runs it forward only and returns the mean loss on every
    rank (evaluation)."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        world: World,
        pcfg: ParallelConfig,
        *,
        bf16: bool,
        embeddings: frozenset[str],
        initial: Values | None = None,
        split: SequenceSplit | None = None,
    ):
        from torch.distributed import pipelining

        tied = _tied(model, plan)
        n_stages, pp, rank = pcfg.pp_stages, world.pp, world.pp_rank
        layers = stage_layers(len(plan.repeated_blocks(model)), n_stages, pcfg.pp_layers)
        mine = list(range(rank, n_stages, pp))
        # This rank's part: the model cut down to its stages' layers.
        part = _cut(model, plan, [i for s in mine for i in layers[s]], 0 in mine, n_stages - 1 in mine)
        # Each rank writes the layers it holds: checkpoints are always sharded.
        super().__init__(part, plan, world, embeddings=embeddings, sharded=True)
        self.whole = None  # decoding runs the stages in turn at each step (``_evaluate``)
        self.pp, self.n_stages = pp, n_stages
        self.group = world.group("pp")
        # This rank's stages: the part itself, or modules sharing its layers when it holds several.
        stages = (
            {mine[0]: part}
            if len(mine) == 1
            else {s: _cut(part, plan, layers[s], s == 0, s == n_stages - 1) for s in mine}
        )
        # Data-parallel replicas of a stage average their gradients once the step's micro-batches
        # are all through the pipeline (``_reduce_gradients``): DDP's per-bucket hooks do not
        # survive a schedule that runs backward piece by piece across several calls.
        self._replicas = world.group("dp") if pcfg.strategy == "ddp" and world.dp > 1 else None
        if self._replicas is None and len(mine) > 1 and world.dp > 1:
            # Several stages per rank: each is FSDP's root for its own layers, as the schedule
            # runs each one's forward and backward apart.
            shard(part, plan, world, pcfg, bf16=bf16, fsdp_roots=list(stages.values()))
        elif self._replicas is None:
            shard(part, plan, world, pcfg, bf16=bf16)
        if initial is not None:
            materialize(part, initial, torch.device("cpu") if pcfg.cpu_offload else world.device)
            for stage in stages.values():
                _share_own_tensors(stage, part)
        self._tie(tied, 0 in mine, n_stages - 1 in mine)
        # Context parallelism: each stage takes and passes on this rank's chunks of the
        # sequences; the last one's result is the whole sequences' (the same on every cp rank).
        for s, stage in stages.items():
            if split is not None:
                split.install(stage, first=s == 0, last=s == n_stages - 1)
        self._stage_modules = stages  # evaluation runs them one after the other, forward only
        self._stand_in = False  # the schedule's next call of the loss is on stand-in tensors
        self.stages = [
            _stage_class(self._stand_in_next)(module, s, n_stages, world.device, group=self.group)
            for s, module in stages.items()
        ]
        self.is_last = n_stages - 1 in mine
        schedule = getattr(pipelining, SCHEDULES[pcfg.pp_schedule])
        # The loss of each piece is weighed here (by its share of the step's loss tokens), so the
        # schedule must not divide the gradients by the number of pieces again.
        kwargs = {"n_microbatches": pcfg.microbatches, "loss_fn": self._weighed, "scale_grads": False}
        self.schedule = schedule(self.stages if len(self.stages) > 1 else self.stages[0], **kwargs)
        self._scale: torch.Tensor | None = None
        self._compute: StepCompute | None = None
        self._staged: Staged | None = None
        self._evaluator = _Evaluator(self)
        if world.tp > 1 and plan.sequence_parallel:
            # Sequence parallelism splits each stage's positions into tp equal shares: the
            # decoder pads its forward passes to whole shares (see PaddedRows).
            setattr(self._evaluator, POSITIONS_MULTIPLE, world.tp)

    def _stand_in_next(self) -> None:
        self._stand_in = True

    def compile(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> Callable[[nn.Module, Any], torch.Tensor]:
        """The schedule, not the loss function, runs the stages here: each layer is compiled instead."""
        for block in self.plan.repeated_blocks(self.module):
            block.compile()
        return loss_fn

    def _weighed(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A piece's mean loss (by default the last stage's output: its loss, fused with its
        output layer) as its part of the micro-batch's loss times the step's weight (and fp16's
        loss scale: the schedule runs the backward pass)."""
        staged = self._staged
        assert staged is not None and self._scale is not None and self._compute is not None  # forward_backward's
        if self._stand_in:  # not a piece: the shapes' inference (see _stage_class)
            self._stand_in = False
            return output.sum() * 0
        return self._compute.scaled(staged.loss(output, target) * staged.count(target) * self._scale)

    def forward_backward(self, batch: Any, divisor: float, *, last: bool, compute: StepCompute) -> torch.Tensor:
        """The schedule cuts ``batch`` (inputs, targets, or the loss function's ``Staged`` form
        of it) into ``parallel.pp_microbatches`` pieces and runs them through the stages; the
        last stage weighs each piece's loss by its share of the batch's loss tokens (or pairs).
        The loss is returned on the last stage, times the pipeline's ranks, and zero on the
        others (the meter averages the loss over every rank)."""
        self._staged = staged = compute.staged(self._evaluator, batch) or _staged_lm(batch)
        weight = 1 / divisor
        self._scale, self._compute = weight / staged.count(staged.target), compute
        losses: list[torch.Tensor] = []
        with compute.autocast():
            self.schedule.step(
                staged.inputs, target=staged.target, losses=losses, return_outputs=False, **staged.keywords
            )
        if last:
            self._reduce_gradients()
        if not self.is_last:
            return torch.zeros((), device=self.world.device)
        scale = compute.scaled(torch.ones((), device=self.world.device))  # fp16's, taken back out
        return torch.stack(losses).sum().detach() * (self.pp / weight) / scale

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm sums over the stages; a tied weight's second copy is clipped but not counted."""
        return clip_grad_norm_(self.parameters(), max_norm, group=self.group, uncounted=self.uncounted)

    def load_whole(self, weights: StoredWeights, optim_state: dict[str, Any]) -> dict[str, Any]:
        """The layers of this rank's stages, from a whole model's checkpoint (sliced where they are sharded)."""
        names = set(self.module.state_dict())
        return load_whole(self.module, weights, _restrict(weights, optim_state, names), part=True)

    def _tie(self, tied: dict[str, str], first: bool, last: bool) -> None:
        """A weight the first and last stage share (tied embeddings) is a copy on each of their
        ranks, equal at the start; summing the two copies' gradients keeps them equal. One group
        per pair of such ranks; every rank takes part in making every group."""
        import torch.distributed as dist

        self._tied_group, self._tied, self.uncounted = None, [], []
        if not tied:
            return
        params = dict(self.module.named_parameters())
        # A frozen tied weight (a LoRA run's embedding) gets no gradient: its copies stay equal.
        names = tied if first else tied.values() if last else ()
        self._tied = [params[name] for name in names if params[name].requires_grad]
        # The last stage's copy is clipped with the first's norm, not counted twice.
        self.uncounted = self._tied if last and not first else []
        ranks = dist.get_process_group_ranks(self.group)
        if self.pp == 2:
            self._tied_group = self.group
            return
        for ends in self.world.pipeline_ends():
            made = dist.new_group(list(ends))
            if list(ends) == [ranks[0], ranks[-1]] and (first or last):
                self._tied_group = made

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        """Average the gradients over the data-parallel replicas (with ``parallel.strategy=ddp``;
        FSDP reduces its own), in one all-reduce of all of them; sum the gradients of the copies
        of a tied weight."""
        import torch.distributed as dist

        for param in self._tied:
            assert param.grad is not None  # a tied weight is used by the forward of its stages
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            dist.all_reduce(grad, group=self._tied_group)
        if self._replicas is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self._replicas)
        flat /= self.world.dp
        for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(reduced.view_as(grad))

    @property
    def eval_forward(self) -> nn.Module:
        return self._evaluator

    @torch.no_grad()
    def _evaluate(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        token_logps: bool = False,
        kv_cache: Any = None,
        logits_to_keep: int = 0,
        decoding: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """The mean loss of ``targets`` (or of ``labels``, aligned with the inputs) given
        ``inputs``, on every rank: the stages run in turn, each passing its hidden states to the
        next, and the last stage's loss is broadcast. With ``token_logps``, each target's
        log-probability instead, as the model gives them (fp32; [rows, length - 1] for labels);
        without targets, the logits (as the last stage computes them: benchmark tasks, and the
        decoder's steps, whose keywords, ``kv_cache`` and ``logits_to_keep`` for kiln's GPT,
        ``decoding`` for a transformers model, every stage takes: each stores its own layers'
        keys and values in the cache, by the layers' places in the whole model)."""
        import torch.distributed as dist

        if labels is not None:
            targets = next_labels(labels)
        if token_logps and targets is None:
            raise ValueError("token log-probabilities are those of targets: give them")
        keywords: dict[str, Any] = _row_keywords(attention_mask, position_ids)
        if positions is not None:
            keywords["positions"] = positions
        if token_logps:
            keywords["token_logps"] = True
        if kv_cache is not None:
            keywords.update(kv_cache=kv_cache, logits_to_keep=logits_to_keep)
        if decoding is not None:
            keywords["decoding"] = decoding
        ranks = dist.get_process_group_ranks(self.group)
        x = inputs
        for s in range(self.n_stages):
            if s % self.pp != self.world.pp_rank:
                continue
            if s > 0:
                shape, dtype = _recv_header(ranks[(s - 1) % self.pp], self.group)
                x = torch.empty(shape, dtype=dtype, device=self.world.device)
                dist.recv(x, ranks[(s - 1) % self.pp], group=self.group)
            x = self._stage_modules[s](x, targets=targets, **keywords)
            if s < self.n_stages - 1:
                _send_header(x, ranks[(s + 1) % self.pp], self.group)
                dist.send(x.contiguous(), ranks[(s + 1) % self.pp], group=self.group)
        last = ranks[(self.n_stages - 1) % self.pp]
        if targets is None:  # logits, of a shape only the last stage knows
            header: list[Any] = [tuple(x.shape), x.dtype] if self.is_last else [None, None]
            dist.broadcast_object_list(header, last, group=self.group)
            out = x.contiguous() if self.is_last else torch.empty(header[0], dtype=header[1], device=self.world.device)
            dist.broadcast(out, last, group=self.group)
            return out[:, : inputs.size(1)]  # context parallelism pads rows to whole chunks
        shape = targets.shape if token_logps else ()
        out = x.float() if self.is_last else torch.zeros(shape, device=self.world.device)
        dist.broadcast(out, last, group=self.group)
        return out[:, :-1] if token_logps and labels is not None else out


class _Evaluator(nn.Module):
    """A pipeline as one module, for evaluation and the forward passes a loss function makes
    besides its own (a reference model's): calling it runs the stages in turn
    (``PipelineModel._evaluate``); its parameters, modes and adapters are this rank's part's."""

    def __init__(self, pipeline: PipelineModel):
        super().__init__()
        self.part = pipeline.module
        self.run = pipeline._evaluate

    @property
    def config(self) -> Any:
        """The model's config, as this rank's part holds it (what the decoder reads of a model)."""
        return self.part.config

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.run(*args, **kwargs)


def _staged_lm(batch: Any) -> Staged:
    """A language model's loss of a text or fine-tuning batch: every stage takes the targets as a
    keyword (the last computes its mean loss with them) with the positions of packed documents
    or the attention mask of padded rows, and the last stage's output is the loss."""
    inputs, targets, keywords = _parts(batch)
    return Staged(
        inputs,
        targets,
        {"targets": targets, **keywords},
        loss=lambda output, target: output,
        count=lambda target: (target != IGNORE_INDEX).sum(),
    )


def _parts(
    batch: tuple[torch.Tensor, torch.Tensor] | TextBatch | TokenBatch,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A batch's inputs, its targets (the next token of each input: a fine-tuning batch's labels
    shifted) and the keywords every stage takes with them: packed documents' positions, padded
    rows' attention mask."""
    if isinstance(batch, TextBatch):
        return batch.inputs, batch.targets, {"positions": batch.positions}
    if isinstance(batch, TokenBatch):
        return batch.input_ids, next_labels(batch.labels), _row_keywords(batch.attention_mask, batch.position_ids)
    inputs, targets = batch
    return inputs, targets, {}


def _row_keywords(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    keywords = {"attention_mask": attention_mask, "position_ids": position_ids}
    return {key: value for key, value in keywords.items() if value is not None}


def _stage_class(inferred: Callable[[], None]) -> type:
    """PyTorch's ``PipelineStage``, learning the shapes it sends with its layers in eval mode.

    On its first step a stage runs one forward pass to learn them (2.13's private
    ``_forward_metadata_inference``), on the first piece again or, past the first stage, on empty
    tensors; in training mode it would add to what layers count in training, such as a mixture
    of experts' load, which moves its routing bias. The last stage then runs the loss once on
    that pass's output to learn the gradients' shapes: ``inferred`` is called before, so that
    this call is not counted as a piece (a loss's metrics). tests/distributed/test_moe_ranks.py
    fails if the method is renamed, tests/train/test_preference_objectives.py (the metrics of
    pipelined DPO) if the loss is no longer called so."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            training = [(m, m.training) for m in self.submod.modules()]
            self.submod.eval()
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for module, mode in training:
                    module.training = mode
                if self.is_last:
                    inferred()

    return Stage


def _restrict(model_state: StoredWeights, optim_state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A whole model's optimizer state (keyed by parameter name) cut down to the parameters
    ``names``. A parameter the whole model shares under two names (a tied embedding)
    has its optimizer state under one of them: a stage that knows it by the other takes it there."""
    states = optim_state["state"]
    source = {}
    for name in names:
        key = model_state.key(name)
        shared = (other for other in states if model_state.key(other) == key)
        source[name] = name if name in states else next(shared, name)
    groups = [
        {**group, "params": [name for name in names if source[name] in group["params"]]}
        for group in optim_state["param_groups"]
    ]
    kept = {name: states[source[name]] for name in names if source[name] in states}
    return {"state": kept, "param_groups": groups}


def _send_header(x: torch.Tensor, dst: int, group: Any) -> None:
    import torch.distributed as dist

    dist.send_object_list([tuple(x.shape), x.dtype], dst, group=group)


def _recv_header(src: int, group: Any) -> tuple[tuple[int, ...], torch.dtype]:
    import torch.distributed as dist

    header: list = [None, None]
    dist.recv_object_list(header, src, group=group)
    return header[0], header[1]
