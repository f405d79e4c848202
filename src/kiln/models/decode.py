"""One decoder for everything in kiln that generates text: ``kiln serve``, the evaluation harness
and GRPO's rollouts (continuous batching over a slot cache).

The cache holds ``slots`` rows, each with its own positions: a row's keys and values sit at the
columns of its own positions (0, 1, ... from its first prompt token), and a mask built from those
positions lets each query see only its own row's earlier tokens. That is the choice between the
two usual designs for rows of different lengths: left padding shifts every row to one shared
column, so a row that arrives later has to fit its prompt into the columns already there; a
paged cache needs its own attention kernel. Per-row columns need neither: a row joins by taking a
free slot and leaves by giving it back, and the model's ordinary attention runs with a mask.

Each step of the ``Decoder`` (1) gives free slots to waiting rows, (2) feeds prompts in chunks of
at most ``max_batch_tokens`` minus the running rows, so that a long prompt does not stall the
rows that are decoding, and (3) decodes one token of every running row in one forward pass of
the batch. Rows waiting together with the same prompt (GRPO's groups, ``n`` completions of one
request) share its prefill: it runs once and its keys and values are copied.

Sampling is per row (temperature, top-k, top-p, a seed) and draws from the row's own generator,
so a row's tokens are those it would get decoded alone. Past ``length`` positions the cache is a
ring: position p is kept in column p % length, over the oldest, so decoding goes on with the last
``length`` tokens in view (keys are stored rotated for their own position, and attention scores
under RoPE depend only on the distance between positions, so the order of the columns does not
matter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# The cache grows by doubling, from this many columns, up to its length: its memory follows the
# rows' lengths rather than the model's context.
FIRST_COLUMNS = 64
UNBOUNDED = 2**31
# Tokens a step feeds the model unless told otherwise: a token of each running row, the rest
# prompt chunks.
DEFAULT_BATCH_TOKENS = 512
# The storage keeps one column past the allocated ones: the padding's scratch column (see
# SlotCache.bind), and what keeps the columns attended a slice of the storage's, never all of it,
# so that a compiled step meets one form of them, whatever the cache's growth.
SPARE_COLUMNS = 1
# Attention reads the columns up to the longest running row's, rounded up to this many (fewer
# distinct shapes for the kernels; the masked columns cost little).
COLUMN_BUCKET = 64


@dataclass(frozen=True)
class Sampling:
    """How a row picks each token: temperature 0 is greedy (argmax); ``top_k`` and ``top_p``
    restrict the draw to the most likely tokens; ``seed`` makes the draw reproducible (None:
    fresh randomness)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling(temperature=0.0)


@dataclass(eq=False)
class Row:
    """One sequence to continue: its prompt's token ids, at most ``max_tokens`` new ones, how to
    sample them, the end-of-text id (the row ends after emitting it) and ``stop``, called with each
    new token, True to end the row there (stop strings). ``tokens`` grows as the row is decoded;
    ``finish`` is ``stop`` or ``length`` once it has ended (``cancelled``: taken out by its owner)."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling = GREEDY
    eos_id: int | None = None
    stop: Callable[[int], bool] | None = None
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    # The decoder's bookkeeping.
    generator: torch.Generator | None = field(default=None, repr=False)
    slot: int = field(default=-1, repr=False)
    fed: int = field(default=0, repr=False)  # prompt tokens in the cache
    window: list[int] = field(default_factory=list, repr=False)  # the prompt as fed (its last `length`)
    followers: list[Row] = field(default_factory=list, repr=False)  # rows sharing this one's prefill

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def position(self) -> int:
        """The position of the last token given (the next to be fed)."""
        return len(self.window) + len(self.tokens) - 1


class SlotCache:
    """Keys and values [slots, kv_heads, columns, head_dim] of each attention layer, each row at
    the columns of its own positions (see the module's docstring); a layer's tensors are made at
    its first ``attend``, in the shape and type of its keys (a tensor-parallel rank's heads, say).
    ``bind`` says which slots the next forward pass feeds and at which positions; each attention
    layer then calls ``attend``."""

    def __init__(self, slots: int, length: int, device: torch.device, multiple: int = 1):
        self.slots, self.length, self.device, self.multiple = slots, length, device, multiple
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.allocated = min(FIRST_COLUMNS, length)
        self.rows = slice(0, 0)
        self.positions = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.at = self.index = self.held = self.positions
        self.columns = self.attended = self.pad = 0
        self.mask = torch.zeros(0, dtype=torch.bool, device=device)

    def bind(self, rows: slice, positions: torch.Tensor, last: Sequence[int]) -> None:
        """The next forward feeds the slots ``rows`` at ``positions`` [B, T] (on the device), the
        last of each row's being ``last`` (host ints, which size the cache without a sync).

        Where a forward's positions must come in multiples of ``multiple`` (sequence parallelism
        splits them evenly over the ranks), ``pad`` tokens go before each row's: the forward
        feeds [B, pad + T] (``positions`` and ``mask`` include them). Their keys and values go to
        a scratch column that only they see, past the columns the rows attend to (a column the
        bound rows reach later, overwritten then, or the storage's extra one), so the rows'
        results are an unpadded forward's and the last position is still a row's last token."""
        need = min(max(last) + 1, self.length)
        if need > self.allocated:
            self._grow(need)
        self.rows = rows
        self.index = torch.arange(positions.size(0), device=self.device)[:, None]
        self.columns = min(self.allocated, -(-need // COLUMN_BUCKET) * COLUMN_BUCKET)
        column = torch.arange(self.columns, device=self.device)
        p = positions[:, :, None]
        if max(last) < self.length:  # no row has wrapped: column j holds position j
            at, held = positions, column
            mask = column <= p
        else:
            at = positions % self.length
            # Column j of a row holds the latest position <= its last that is j modulo length; a
            # query at position p sees it when that position is neither after p nor length or
            # more before.
            end = torch.tensor(last, device=self.device)[:, None]
            held = (end - (end - column).remainder(self.length))[:, None]  # [B, 1, columns]; < 0: never written
            mask = (held >= 0) & (held <= p) & (held > p - self.length)
        self.pad = -positions.size(1) % self.multiple
        self.attended = self.columns + bool(self.pad)
        if self.pad:
            rows_, pad = positions.size(0), self.pad
            at = torch.cat([at.new_full((rows_, pad), self.columns), at], dim=1)
            positions = torch.cat([positions[:, :1].expand(rows_, pad), positions], dim=1)
            held = F.pad(held, (0, 1), value=UNBOUNDED)  # in any window of the padding's own queries
            own = torch.zeros(rows_, pad, self.attended, dtype=torch.bool, device=self.device)
            own[..., -1] = True
            mask = torch.cat([own, F.pad(mask.expand(rows_, -1, -1), (0, 1), value=False)], dim=1)
        self.at, self.held, self.mask, self.positions = at, held, mask, positions

    def window_mask(self, window: int) -> torch.Tensor:
        """The bound mask [B, T, columns] of attention over the last ``window`` positions only
        (a sliding-window layer's: Mistral's, Gemma's local layers)."""
        return self.mask & (self.held > self.positions[:, :, None] - window)

    def _grow(self, need: int) -> None:
        while self.allocated < need:
            self.allocated = min(2 * self.allocated, self.length)
        for cache in (self.k, self.v):
            for i, old in cache.items():
                shape = (*old.shape[:2], self.allocated + SPARE_COLUMNS, old.size(3))
                cache[i] = torch.zeros(shape, device=old.device, dtype=old.dtype)
                kept = old.size(2) - SPARE_COLUMNS
                cache[i][:, :, :kept] = old[:, :, :kept]

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the bound rows' new keys and values k, v [B, kv_heads, T, head_dim] of ``layer``:
        the keys and values their queries attend to [B, kv_heads, columns, head_dim], and which
        of them each query sees [B, 1, T, columns]."""
        if layer not in self.k:
            shape = (self.slots, k.size(1), self.allocated + SPARE_COLUMNS, k.size(3))
            self.k[layer] = torch.zeros(shape, device=k.device, dtype=k.dtype)
            self.v[layer] = torch.zeros(shape, device=v.device, dtype=v.dtype)
        keys, values = self.k[layer][self.rows], self.v[layer][self.rows]
        keys[self.index, :, self.at] = k.transpose(1, 2).to(keys.dtype)
        values[self.index, :, self.at] = v.transpose(1, 2).to(values.dtype)
        return keys[:, :, : self.attended], values[:, :, : self.attended], self.mask[:, None]

    def layer(self, index: int) -> CacheLayer:
        return CacheLayer(self, index)

    def copy(self, source: int, targets: list[int], columns: int) -> None:
        """Give the slots ``targets`` the first ``columns`` columns of slot ``source``."""
        if targets:
            for cache in (self.k, self.v):
                for layer in cache.values():
                    layer[targets, :, :columns] = layer[source, :, :columns]

    def swap(self, a: int, b: int) -> None:
        if a != b:
            for cache in (self.k, self.v):
                for layer in cache.values():
                    layer[[a, b]] = layer[[b, a]]


@dataclass(frozen=True)
class CacheLayer:
    """One layer's view of a bound ``SlotCache``: what a model's attention layer is given."""

    cache: SlotCache
    index: int

    def attend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cache.attend(self.index, k, v)


# The attribute of a model whose forward passes must feed positions in multiples of some number
# (its layout says so: sequence parallelism splits them evenly over the ranks); the decoder pads.
POSITIONS_MULTIPLE = "kiln_positions_multiple"


def positions_multiple(module: nn.Module) -> int:
    return getattr(module, POSITIONS_MULTIPLE, 1)


# (forward passes this rank ran in a step, whether it still has rows) -> (the most any rank ran,
# whether any rank still has rows): Decoder.run's agreement between ranks.
Lockstep = Callable[[int, bool], Sequence[float]]


class Decodable(Protocol):
    """What the decoder needs of a model: the ``module`` (put in eval mode while decoding), its
    ``context`` (positions it can attend over; None: unknown), and ``forward``, the next-token
    logits [B, vocab] after the last of tokens [B, T] fed into a bound ``SlotCache`` (only the
    last position's: a prompt's others would cost T times the output layer)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def context(self) -> int | None: ...

    def forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor: ...


class Decoder:
    """Rows in, tokens out, one step at a time (see the module's docstring): ``add`` rows, then
    ``step`` until ``busy`` is False (or ``run`` them to the end); each step returns the (row,
    token) pairs it made. A row that ``cancel`` takes out leaves at the next step. ``length``:
    the positions a row sees (the model's context by default; past them the cache is a ring);
    ``max_batch``: rows decoded at once; ``max_batch_tokens``: tokens a step feeds the model, one
    per running row and the rest prompt chunks (by default DEFAULT_BATCH_TOKENS, or max_batch
    if more)."""

    def __init__(
        self,
        model: Decodable,
        *,
        length: int | None = None,
        max_batch: int = 8,
        max_batch_tokens: int | None = None,
        device: torch.device | None = None,
    ):
        max_batch_tokens = max_batch_tokens or max(DEFAULT_BATCH_TOKENS, max_batch)
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        if max_batch_tokens < max_batch:
            raise ValueError(
                f"max_batch_tokens ({max_batch_tokens}) must be at least max_batch ({max_batch}):"
                " each running row feeds one token a step"
            )
        self.model = model
        # No known context: no ring (the cache only grows with the rows).
        self.length = length or model.context or UNBOUNDED
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.device = device or next(model.module.parameters()).device
        self.multiple = positions_multiple(model.module)
        self.cache = SlotCache(max_batch, self.length, self.device, self.multiple)
        self.waiting: list[Row] = []
        self.filling: list[Row] = []  # their prompts being fed
        self.running: list[Row] = []  # running[i] sits in slot i
        self.owner: list[Row | None] = [None] * max_batch
        self.forwards = 0  # forward passes run, idle ones included
        self._scratch: SlotCache | None = None  # the idle passes' one-slot cache

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.filling or self.running)

    def add(self, rows: Iterable[Row]) -> None:
        for row in rows:
            if row.max_tokens < 1:
                raise ValueError(f"a row needs max_tokens of at least 1, not {row.max_tokens}")
            if not row.prompt:
                raise ValueError("a row needs a prompt of at least one token")
            row.window = list(row.prompt[-self.length :])
            row.generator = _generator(row.sampling, self.device)
            self.waiting.append(row)

    def cancel(self, row: Row) -> None:
        if not row.done:
            row.finish = "cancelled"

    def step(self) -> list[tuple[Row, int]]:
        """One step: admit, feed prompt chunks, decode a token of every running row."""
        with self._evaluating():
            return self._step()

    def run(self, rows: Iterable[Row], lockstep: Lockstep | None = None) -> None:
        """Decode ``rows`` to the end. Where each forward pass is a collective of several ranks
        (a sharded model's layers gather their parameters from every rank), ``lockstep(forwards,
        busy)`` is asked after each step and answers (the most forwards a rank ran, whether any
        rank still has rows): a rank that ran fewer runs idle ones, and every rank steps until
        none has rows left."""
        self.add(rows)
        with self._evaluating():
            while True:
                ran = self.forwards
                if self.busy:
                    self._step()
                ran = self.forwards - ran
                most, anyone = lockstep(ran, self.busy) if lockstep is not None else (ran, self.busy)
                for _ in range(int(most) - ran):
                    self._idle()
                if not anyone:
                    return

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """The model in eval mode, without gradients, giving it its own mode back after. no_grad,
        not inference_mode: a run samples from the model it trains, whose float8 training layers
        (train.precision=fp8) refuse inference-mode tensors."""
        module = self.model.module
        training = module.training
        if training:  # switching walks every module: once, not at each step
            module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            if training:
                module.train()

    def _step(self) -> list[tuple[Row, int]]:
        self._drop_cancelled()
        self._admit()
        made: list[tuple[Row, torch.Tensor]] = []
        if self.running:
            made += self._decode()
        made += self._fill(self.max_batch_tokens - len(self.running))
        if not made:
            return []
        ids = torch.cat([t for _, t in made]).tolist()  # the step's one wait for the device
        out = []
        for (row, _), token in zip(made, ids, strict=True):
            out.append((row, token))
            row.tokens.append(token)
            if token == row.eos_id or (row.stop is not None and row.stop(token)):
                row.finish = "stop"
            elif len(row.tokens) >= row.max_tokens:
                row.finish = "length"
        self._drop_finished()
        return out

    def _admit(self) -> None:
        while self.waiting and None in self.owner:
            row = self.waiting.pop(0)
            row.slot = self.owner.index(None)
            self.owner[row.slot] = row
            leader = next((r for r in self.filling if r.fed == 0 and r.window == row.window), None)
            if leader is not None:
                leader.followers.append(row)
            else:
                self.filling.append(row)

    def _fill(self, budget: int) -> list[tuple[Row, torch.Tensor]]:
        """Feed prompt chunks of at most ``budget`` tokens in all; the first tokens of the rows
        whose prompts are complete."""
        made = []
        for row in list(self.filling):
            if budget <= 0:
                break
            start = row.fed
            chunk = row.window[start : start + budget]
            budget -= len(chunk)
            tokens = torch.tensor([chunk], device=self.device)
            positions = torch.arange(start, start + len(chunk), device=self.device)[None]
            self.cache.bind(slice(row.slot, row.slot + 1), positions, [start + len(chunk) - 1])
            logits = self._forward(tokens, self.cache)
            row.fed += len(chunk)
            if row.fed < len(row.window):
                continue
            self.filling.remove(row)
            group, row.followers = [row, *row.followers], []
            self.cache.copy(row.slot, [r.slot for r in group[1:]], len(row.window))
            for member in group:
                member.fed = row.fed
                self._move(member, len(self.running))
                self.running.append(member)
                made.append((member, _sample(logits, [member])))
        return made

    def _decode(self) -> list[tuple[Row, torch.Tensor]]:
        rows = self.running
        tokens = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
        last = [r.position for r in rows]
        self.cache.bind(slice(0, len(rows)), torch.tensor(last, device=self.device)[:, None], last)
        logits = self._forward(tokens, self.cache)
        sampled = _sample(logits, rows)
        return [(r, sampled[i : i + 1]) for i, r in enumerate(rows)]

    def _forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        self.forwards += 1
        if cache.pad:  # any token: the padding's results are never read
            tokens = torch.cat([tokens[:, :1].expand(-1, cache.pad), tokens], dim=1)
        return self.model.forward(tokens, cache)

    def _idle(self) -> None:
        """A forward pass whose result is dropped: one token in a cache of its own."""
        if self._scratch is None:
            self._scratch = SlotCache(1, 1, self.device, self.multiple)
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # the token and its position
        self._scratch.bind(slice(0, 1), zero, [0])
        self._forward(zero, self._scratch)

    def _move(self, row: Row, slot: int) -> None:
        """Put ``row`` in ``slot``, swapping with whatever holds it."""
        if row.slot != slot:
            other = self.owner[slot]
            self.cache.swap(row.slot, slot)
            self.owner[row.slot], self.owner[slot] = other, row
            if other is not None:
                other.slot = row.slot
            row.slot = slot

    def _release(self, row: Row) -> None:
        self.owner[row.slot] = None
        row.slot = -1

    def _drop_cancelled(self) -> None:
        self.waiting = [r for r in self.waiting if not r.done]
        for row in list(self.filling):
            for follower in [r for r in row.followers if r.done]:
                row.followers.remove(follower)
                self._release(follower)
            if row.done:
                self.filling.remove(row)
                self._release(row)
                if row.followers:  # the first follower feeds the prompt itself
                    heir, *heir.followers = row.followers
                    heir.fed = 0
                    self.filling.append(heir)
                row.followers = []
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Rows that ended give their slots back; running rows past the gaps move into them."""
        for row in self.running:
            if row.done:
                self._release(row)
        self.running = [r for r in self.running if not r.done]
        holes = [slot for slot in range(len(self.running)) if self.owner[slot] is None]
        for row, slot in zip([r for r in self.running if r.slot >= len(self.running)], holes, strict=True):
            self._move(row, slot)
        self.running.sort(key=lambda r: r.slot)


def _generator(sampling: Sampling, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator


def _sample(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """One token per row [B] from next-token logits [B, V], each with its sampling settings."""
    settings = [r.sampling for r in rows]
    if all(s.greedy for s in settings):
        return logits.argmax(dim=-1)
    return sample_rows(logits, settings, [r.generator for r in rows])


def sample_rows(
    logits: torch.Tensor, settings: Sequence[Sampling], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row [B] from logits [B, V], each row drawn with its own settings and from its
    own generator, so that a row's draw does not depend on the other rows: the Gumbel-max trick
    (the argmax of the logits plus Gumbel noise is a sample of their softmax), with noise from
    each row's generator."""
    vocab = logits.size(-1)
    device = logits.device
    temperature = torch.tensor([s.temperature or 1.0 for s in settings], device=device)
    scaled = logits.float() / temperature[:, None]
    top_k = [s.top_k if s.top_k is not None and s.top_k < vocab else vocab for s in settings]
    top_p = [s.top_p if s.top_p is not None and s.top_p < 1.0 else 1.0 for s in settings]
    if min(top_k) < vocab or min(top_p) < 1.0:
        # A token is dropped past a row's top_k, or when the tokens ranked above it already hold
        # top_p of the probability (so the most likely always stays).
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        above = probs.cumsum(dim=-1) - probs
        rank = torch.arange(vocab, device=device)
        drop = (rank >= torch.tensor(top_k, device=device)[:, None]) | (
            above >= torch.tensor(top_p, device=device)[:, None]
        )
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    noise = torch.stack(
        [
            torch.rand(vocab, device=device, generator=g) if g is not None else torch.full((vocab,), 0.5, device=device)
            for g in generators
        ]
    )
    gumbel = -torch.log(-torch.log(noise.clamp(min=1e-20, max=1.0 - 1e-7)))
    drawn = (scaled + gumbel).argmax(dim=-1)
    greedy = torch.tensor([s.greedy for s in settings], device=device)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


class CompiledDecoding:
    """``decodable`` with its decode steps (one token a row) compiled by ``torch.compile``, with
    dynamic shapes, so that rows joining and leaving and the cache growing do not compile again;
    prompt chunks run eagerly. On a small model, whose step is mostly Python
    and kernel launches, the compiled step is 1.6-1.7x faster on a CPU (BENCHMARKS.md), after
    about a minute of compiling at the first steps (``warm_up``): worth it for a server."""

    def __init__(self, decodable: Decodable):
        self.module, self.context = decodable.module, decodable.context
        self.eager = decodable.forward
        self.step = torch.compile(decodable.forward, dynamic=True)

    def forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        # The compiled form feeds a token to each of the rows from slot 0 on: the decode steps
        # (a one-token prompt chunk for another slot would compile a form of its own).
        if tokens.size(1) > 1 or cache.rows.start != 0:
            return self.eager(tokens, cache)
        with _distinct_sizes():
            return self.step(tokens, cache)

    def warm_up(self, length: int | None = None) -> None:
        """Compile now both forms of the step that decoding meets: batches of several rows and of
        one (a size of 1 is compiled apart). The columns attended are always a slice of the
        cache's (see SPARE_COLUMNS), so its growth meets no third form."""
        short = [0] * 4
        Decoder(self, length=length or self.context or UNBOUNDED, max_batch=2).run([Row(short, 3), Row(short[1:], 2)])


def _distinct_sizes() -> contextlib.AbstractContextManager:
    """Compiling, sizes that happen to be equal when the step is traced (the cache's slots and the
    running rows, its columns and those attended) are kept as distinct symbols, so that the code
    does not compile again when they part. The switch is private to torch's symbolic shapes
    (torch.fx.experimental._config.use_duck_shape; there is no public one): here alone, and
    tests/models/test_decode.py fails if it goes."""
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False)  # type: ignore[attr-defined]  # set up at import by torch


def generate(
    model: Decodable,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    seed: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    max_batch: int = 64,
) -> list[list[int]]:
    """Each prompt's continuation (up to and including ``eos_id`` where it ends there), all
    decoded in one batch of at most ``max_batch`` rows; row i draws from ``seed`` + i."""
    rows = [
        Row(
            prompt,
            max_new_tokens,
            Sampling(temperature, top_k, top_p, None if seed is None else seed + i),
            eos_id,
        )
        for i, prompt in enumerate(prompts)
    ]
    batch = max(1, min(max_batch, len(rows)))
    Decoder(model, max_batch=batch).run(rows)
    return [row.tokens for row in rows]
