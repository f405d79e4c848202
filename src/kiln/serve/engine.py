"""The model side of ``kiln serve``: one worker thread owns the model and decodes the requests.

Up to ``parallel`` requests are decoded at once, one token of each in turn (each with its own KV
cache and random generator, so a request's tokens do not depend on what else is running); the
rest wait in a queue. Each request's text goes back to its HTTP handler through its own asyncio
queue, so the event loop never runs the model.

Scoring (the log-probabilities of given tokens, for ``echo`` and ``logprobs``) is one more kind of
work for the same worker: a request's sequences go through the model in as few forward passes as
fit (padded on the right, which a causal model's real positions never see), each a single turn.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.data.tokenizer import Codec
from kiln.models.gpt.moe import MoE
from kiln.train.run import LoadedRun

log = logging.getLogger("kiln.serve")

# Prompt tokens decoded in front of the generated ones, so that a tokenizer that writes a token
# differently at the start of a text (SentencePiece drops the leading space) spells it as it will
# read in the whole text.
PROMPT_CONTEXT = 4


class ServeError(Exception):
    """This run cannot be served (its model does not generate text)."""


class QueueFullError(Exception):
    """More requests wait for the model than the server takes (``--max-queue``)."""


class TextStream:
    """The text of the generated tokens as it grows, released piece by piece.

    All the tokens so far are decoded together at each step, so characters of several bytes and
    tokenizers that join tokens come out right; text is held back while it ends in U+FFFD (the
    rest of a character is still to come) or in the beginning of a stop string. The text ends
    before the first stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt: list[int], stop: list[str]):
        self.decode = decode
        self.context = prompt[-PROMPT_CONTEXT:]
        self.prefix = decode(self.context)
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.released = 0

    def add(self, token: int) -> tuple[str, bool]:
        """Take one more token: the text it releases, and whether a stop string ended the text."""
        self.ids.append(token)
        self.text = self.decode(self.context + self.ids)[len(self.prefix) :]
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            return self.rest(), True
        settled = self.text.rstrip("\ufffd")
        return self._release(len(settled) - _stop_prefix(settled, self.stop)), False

    def rest(self) -> str:
        """All the text not released yet."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.released : end]
        self.released = max(self.released, end)
        return piece


def _stop_prefix(text: str, stop: list[str]) -> int:
    """The length of the longest end of ``text`` that a stop string begins with (0: none)."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


@dataclass
class GenerationRequest:
    """One request for the worker: a prompt's token ids and how to continue it."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # None: fresh randomness
    cancelled: bool = False  # set by the handler once nobody waits for the answer


@dataclass(frozen=True)
class Update:
    """Text released by one step; the last update has the finish_reason (``stop``: end-of-text
    or a stop string, ``length``: max_tokens), the count of generated tokens and their ids
    (an end-of-text token that ended the answer among them)."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    token_ids: tuple[int, ...] = ()


@dataclass
class Score:
    """Log-probabilities of a sequence's tokens from ``first`` on (``first`` >= 1: the first token
    has nothing before it to be predicted from), and the ``top`` most likely tokens at each of
    those positions, each token's log-probability given the tokens before it."""

    tokens: list[int]
    first: int
    top: int = 0


@dataclass(frozen=True)
class Scored:
    """What ``Engine.score`` found for one ``Score``: per position from ``first``, the token's
    log-probability and the ids and log-probabilities of the most likely tokens, most likely first."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


# A forward pass for scoring holds at most about this many bytes of float32 log-probabilities;
# sequences that would pass it go through the model in further passes (a long one alone).
SCORE_BYTES = 256 * 2**20

Emit = Callable[[Update | list[Scored] | Exception], None]


class Engine:
    """The worker thread that owns the model (see the module's docstring)."""

    def __init__(self, run: LoadedRun, parallel: int = 8, max_model_len: int | None = None, max_queue: int = 256):
        if parallel < 1:
            raise ServeError(f"parallel must be at least 1, not {parallel}")
        if max_queue < 1:
            raise ServeError(f"--max-queue must be at least 1, not {max_queue}")
        self.max_queue = max_queue
        if max_model_len is not None and max_model_len < 2:
            raise ServeError(f"--max-model-len must be at least 2, not {max_model_len}")
        self.run = run
        self.codec = Codec(run.tokenizer)
        # A token id past the embedding's rows would index out of it (on CUDA, a device assert
        # that ends the server): ids are checked against the smaller of the two vocabularies.
        rows = next((m.num_embeddings for m in run.model.modules() if isinstance(m, nn.Embedding)), None)
        self.codec.vocab_size = min(self.codec.vocab_size, rows or self.codec.vocab_size)
        context = run.family.context_length(run.args)
        self.context = min(filter(None, (context, max_model_len)), default=None)
        self.device = next(run.model.parameters()).device
        self.parallel = parallel
        probe = run.family.stream(run.model, torch.zeros(1, 1, dtype=torch.long, device=self.device), 1)
        if probe is None:
            raise ServeError(f"model family {run.cfg.model.family} ({run.cfg.model.task}) cannot generate text")
        probe.close()
        self._inbox: queue.SimpleQueue[tuple[GenerationRequest | list[Score], Emit] | None] = queue.SimpleQueue()
        # A mixture of experts whose experts take a limited share of a pass's tokens routes a
        # token differently beside others: such a model scores one sequence per pass, unpadded.
        self.score_alone = any(isinstance(m, MoE) and m.capacity for m in run.model.modules())
        self._thread = threading.Thread(target=self._work, name="kiln-serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the worker after its current step; requests still running or waiting get an error."""
        self._inbox.put(None)
        self._thread.join()

    async def generate(self, job: GenerationRequest) -> AsyncIterator[Update]:
        """Queue the job and yield its updates up to the last; a failure in the worker is raised
        here. Leaving early (the client disconnected) cancels the job."""
        updates = self._submit(job)
        try:
            while True:
                update = await updates.get()
                if isinstance(update, Exception):
                    raise RuntimeError(f"generation failed: {update}") from update
                assert isinstance(update, Update)
                yield update
                if update.finish_reason:
                    return
        finally:
            job.cancelled = True

    async def score(self, scores: list[Score]) -> list[Scored]:
        """The log-probabilities that ``scores`` ask for, computed by the worker in its turn."""
        if not scores:
            return []
        answer = await self._submit(scores).get()
        if isinstance(answer, Exception):
            raise RuntimeError(f"scoring failed: {answer}") from answer
        assert isinstance(answer, list)
        return answer

    def check_room(self) -> None:
        """QueueFullError when max_queue requests wait already."""
        if self._inbox.qsize() >= self.max_queue:
            raise QueueFullError(f"{self._inbox.qsize()} requests are waiting for the model; try again shortly")

    def _submit(self, work: GenerationRequest | list[Score]) -> asyncio.Queue[Update | list[Scored] | Exception]:
        """Queue work for the worker: what it sends back arrives in the returned queue (or
        QueueFullError: the client is told to come back, 429)."""
        self.check_room()
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Update | list[Scored] | Exception] = asyncio.Queue()

        def emit(answer: Update | list[Scored] | Exception) -> None:
            try:
                loop.call_soon_threadsafe(answers.put_nowait, answer)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                if isinstance(work, GenerationRequest):
                    work.cancelled = True

        self._inbox.put((work, emit))
        return answers

    def _work(self) -> None:
        active: list[_Decoding | _Scoring] = []
        while True:
            while len(active) < self.parallel:
                try:
                    item = self._inbox.get(block=not active)  # wait for work only when there is none
                except queue.Empty:
                    break
                if item is None:
                    self._drop(active)
                    return
                work, emit = item
                active.append(
                    _Decoding(self, work, emit) if isinstance(work, GenerationRequest) else _Scoring(self, work, emit)
                )
            active = [decoding for decoding in active if decoding.step()]

    def _drop(self, active: list[_Decoding | _Scoring]) -> None:
        """At shutdown: tell every request still running or waiting that it will get no answer."""
        gone = RuntimeError("the server is shutting down")
        for decoding in active:
            decoding.close()
            decoding.emit(gone)
        while not self._inbox.empty():
            item = self._inbox.get()
            if item is not None:
                item[1](gone)


class _Decoding:
    """One job being decoded: its token stream (opened at its first step) and its text."""

    def __init__(self, engine: Engine, job: GenerationRequest, emit: Emit):
        self.engine = engine
        self.job = job
        self.emit = emit
        self.tokens: Generator[torch.Tensor, None, None] | None = None
        self.text: TextStream  # made with the stream, where a failure is this request's alone
        self.ids: list[int] = []

    def step(self) -> bool:
        """Decode one token and send what it releases; False once the job is over."""
        job = self.job
        if job.cancelled:
            self.close()
            return False
        finish: str | None  # None: the job goes on
        try:
            if self.tokens is None:
                self.tokens = self._open()
            token = next(self.tokens, None)  # None: the family's stream ended by itself
            if token is not None:
                self.ids.append(int(token[0]))
            if token is None or self.ids[-1] == self.engine.codec.eos_id:
                finish, piece = "stop", self.text.rest()
            else:
                piece, stopped = self.text.add(self.ids[-1])
                finish = "stop" if stopped else "length" if len(self.ids) == job.max_tokens else None
                if finish == "length":
                    piece += self.text.rest()
        except Exception as e:  # the failure belongs to this request; the worker goes on with the others
            log.exception("generation failed")
            self.emit(e)
            self.close()
            return False
        if piece or finish:
            self.emit(Update(piece, finish, len(self.ids), tuple(self.ids) if finish else ()))
        if finish:
            self.close()
        return finish is None

    def _open(self):
        job, run = self.job, self.engine.run
        self.text = TextStream(self.engine.codec.decode, job.prompt, job.stop)
        generator = torch.Generator(device=self.engine.device)
        if job.seed is None:
            generator.seed()
        else:
            generator.manual_seed(job.seed)
        prompt = torch.tensor([job.prompt], device=self.engine.device)
        return run.family.stream(
            run.model,
            prompt,
            job.max_tokens,
            temperature=job.temperature,
            top_k=job.top_k,
            top_p=job.top_p,
            eos_id=self.engine.codec.eos_id,
            generator=generator,
        )

    def close(self) -> None:
        """Close the token stream, which gives the model its own train/eval mode back."""
        if self.tokens is not None:
            self.tokens.close()


class _Scoring:
    """One request's scoring, done in a single turn of the worker (see ``Engine.score``)."""

    def __init__(self, engine: Engine, scores: list[Score], emit: Emit):
        self.engine = engine
        self.scores = scores
        self.emit = emit

    def step(self) -> bool:
        try:
            model = self.engine.run.model
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():  # not inference_mode, as in generation (float8 layers refuse it)
                    scored = [s for group in self._groups() for s in score(model, group, self.engine.device)]
            finally:
                model.train(was_training)
        except Exception as e:  # the failure belongs to this request; the worker goes on with the others
            log.exception("scoring failed")
            self.emit(e)
            return False
        self.emit(scored)
        return False

    def _groups(self) -> list[list[Score]]:
        """The scores in order, cut into forward passes of about ``SCORE_BYTES`` of
        log-probabilities each (one sequence per pass for a model that must see each alone)."""
        vocab = max(1, self.engine.codec.vocab_size)
        groups: list[list[Score]] = []
        longest = 0
        for s in self.scores:
            length = len(s.tokens) - 1
            if groups and not self.engine.score_alone:
                wider = max(longest, length)
                if (len(groups[-1]) + 1) * wider * vocab * 4 <= SCORE_BYTES:
                    groups[-1].append(s)
                    longest = wider
                    continue
            groups.append([s])
            longest = length
        return groups

    def close(self) -> None:
        pass


def score(model: nn.Module, scores: list[Score], device: torch.device) -> list[Scored]:
    """The log-probabilities ``scores`` ask for, from one forward pass of their sequences (all but
    each one's last token) padded on the right: the model's log-softmax in float32 over its whole
    vocabulary at each position. The answer comes to the host in one copy of each kind at the end."""
    starts = [s.first - 1 for s in scores]  # the position that predicts each one's first scored token
    start, width = min(starts), max(len(s.tokens) for s in scores) - 1
    if width <= start:  # nothing to score (one-token prompts, echoed)
        return [Scored([], [], []) for _ in scores]
    rows = torch.tensor([s.tokens + [0] * (width + 1 - len(s.tokens)) for s in scores]).to(device, non_blocking=True)
    logits = model(rows[:, :-1])
    if not isinstance(logits, torch.Tensor) or logits.shape[:2] != (len(scores), width):
        raise RuntimeError("this model gives no next-token logits [batch, positions, vocabulary] to score with")
    logprobs = logits[:, start:].float().log_softmax(dim=-1)
    top = min(max(s.top for s in scores), logprobs.size(-1))
    values, ids = logprobs.topk(top, dim=-1)  # top 0: empty
    picked = logprobs.gather(-1, rows[:, start + 1 :, None])
    floats, ints = torch.cat([picked, values], dim=-1).tolist(), ids.tolist()
    out = []
    for i, s in enumerate(scores):
        kept = range(starts[i] - start, len(s.tokens) - 1 - start)
        out.append(
            Scored(
                [floats[i][p][0] for p in kept],
                [ints[i][p][: s.top] for p in kept],
                [floats[i][p][1 : 1 + s.top] for p in kept],
            )
        )
    return out
