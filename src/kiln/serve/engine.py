"""The model side of ``kiln serve``: one worker thread owns the model and decodes the requests.

Every running request is a row of one batch (``kiln.models.decode``: continuous batching): each
step feeds prompt chunks of the requests that arrived and decodes one token of every running
request in a single forward pass; requests that end leave the batch and waiting ones join it
between steps. Up to ``max_batch`` rows run at once, the rest wait in a queue. Each row samples
from its own generator, so a request's tokens do not depend on what else is running. Each
request's text goes back to its HTTP handler through its own asyncio queue, so the event loop
never runs the model.

Scoring (the log-probabilities of given tokens, for ``echo`` and ``logprobs``) is one more kind of
work for the same worker, done between two steps: a request's sequences go through the model in
as few forward passes as fit (padded on the right, which a causal model's real positions never
see).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.data.tokenizer import Codec
from kiln.models.decode import CompiledDecoding, Decoder, Row, Sampling
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

    def __init__(
        self,
        run: LoadedRun,
        max_batch: int = 8,
        max_model_len: int | None = None,
        max_queue: int = 256,
        max_batch_tokens: int = 512,
        compiled: bool = False,
    ):
        if max_batch < 1:
            raise ServeError(f"--max-batch must be at least 1, not {max_batch}")
        if max_batch_tokens < max_batch:
            raise ServeError(f"--max-batch-tokens ({max_batch_tokens}) must be at least --max-batch ({max_batch})")
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
        decodable = run.family.decoding(run.model)
        if decodable is None:
            raise ServeError(f"model family {run.cfg.model.family} ({run.cfg.model.task}) cannot generate text")
        # A mixture of experts whose experts take a limited share of a pass's tokens routes a
        # token differently beside others: such a model decodes and scores one sequence a pass.
        self.score_alone = any(isinstance(m, MoE) and m.capacity for m in run.model.modules())
        if self.score_alone and max_batch > 1:
            log.warning("a mixture of experts with a capacity: one request decoded at a time (--max-batch 1)")
            max_batch = 1
        if compiled:  # compiled here, before the server answers anything
            decodable = CompiledDecoding(decodable)
            decodable.warm_up(context)
        self.decoder = Decoder(
            decodable, length=context, max_batch=max_batch, max_batch_tokens=max_batch_tokens, device=self.device
        )
        self.max_batch = max_batch
        self.stats = Stats()
        self._inbox: queue.SimpleQueue[tuple[GenerationRequest | list[Score], Emit] | None] = queue.SimpleQueue()
        self._requests: dict[Row, _Request] = {}
        # What the worker's turn emitted, by the event loop it goes to (see _send).
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
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
        failed: Exception | None = None
        try:
            while failed is None:
                update = await updates.get()
                if isinstance(update, Exception):
                    failed = update
                    break
                assert isinstance(update, Update)
                # The text of steps this client has fallen behind on goes out as one update: under
                # load the event loop writes fewer, longer chunks instead of falling further behind.
                while not update.finish_reason and not updates.empty():
                    more = updates.get_nowait()
                    if isinstance(more, Exception):
                        failed = more
                        break
                    assert isinstance(more, Update)
                    update = Update(update.text + more.text, more.finish_reason, more.completion_tokens, more.token_ids)
                yield update
                if update.finish_reason:
                    return
            raise RuntimeError(f"generation failed: {failed}") from failed
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

    @property
    def waiting(self) -> int:
        """Requests not yet running (read from other threads: a sum of sizes, never exact)."""
        return self._inbox.qsize() + len(self.decoder.waiting)

    def check_room(self) -> None:
        """QueueFullError when max_queue requests wait already."""
        if self.waiting >= self.max_queue:
            raise QueueFullError(f"{self.waiting} requests are waiting for the model; try again shortly")

    def metrics(self) -> str:
        """The engine's state in Prometheus' text format (``GET /metrics``)."""
        return self.stats.render(self.waiting, len(self._requests) - len(self.decoder.waiting))

    def _submit(self, work: GenerationRequest | list[Score]) -> asyncio.Queue[Update | list[Scored] | Exception]:
        """Queue work for the worker: what it sends back arrives in the returned queue (or
        QueueFullError: the client is told to come back, 429)."""
        self.check_room()
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Update | list[Scored] | Exception] = asyncio.Queue()

        def emit(answer: Update | list[Scored] | Exception) -> None:
            self._outbox.setdefault(loop, []).append((answers, answer, work))

        self._inbox.put((work, emit))
        return answers

    def _send(self) -> None:
        """Hand what the worker's last turn emitted to the event loops: one wake-up of each loop
        a turn, not one a token (each wakes its thread, which takes the interpreter's lock)."""
        outbox, self._outbox = self._outbox, {}
        for loop, answers in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, answers)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                for _, _, work in answers:
                    if isinstance(work, GenerationRequest):
                        work.cancelled = True

    def _work(self) -> None:
        while True:
            self._send()
            while True:
                idle = not self.decoder.busy
                if idle:
                    self._send()  # what scoring answered, before waiting
                try:
                    item = self._inbox.get(block=idle)  # wait for work only when there is none
                except queue.Empty:
                    break
                if item is None:
                    self._drop()
                    return
                work, emit = item
                if isinstance(work, GenerationRequest):
                    self._start(work, emit)
                else:
                    _Scoring(self, work, emit).step()
            for row, request in self._requests.items():
                if request.job.cancelled:
                    self.decoder.cancel(row)
            try:
                made = self.decoder.step()
            except Exception as e:  # the step's rows fail together; the worker goes on with new ones
                log.exception("generation failed")
                self._fail(e)
                continue
            if made:
                self.stats.count(made)
            for row, token in made:
                self._requests[row].take(token)
            for row in [r for r in self._requests if r.done]:
                del self._requests[row]

    def _start(self, job: GenerationRequest, emit: Emit) -> None:
        sampling = Sampling(job.temperature, job.top_k, job.top_p, job.seed)
        request = _Request(job, emit, TextStream(self.codec.decode, job.prompt, job.stop))
        request.row = Row(job.prompt, job.max_tokens, sampling, self.codec.eos_id, stop=request.add)
        self._requests[request.row] = request
        self.stats.prompt_tokens += len(job.prompt)
        self.decoder.add([request.row])

    def _fail(self, error: Exception) -> None:
        """Every request in the decoder gets ``error``; a new decoder takes over (the failed step
        may have left the old one's cache half written)."""
        for request in self._requests.values():
            request.emit(error)
        self._requests.clear()
        old = self.decoder
        self.decoder = Decoder(
            old.model,
            length=old.length,
            max_batch=old.max_batch,
            max_batch_tokens=old.max_batch_tokens,
            device=old.device,
        )

    def _drop(self) -> None:
        """At shutdown: tell every request still running or waiting that it will get no answer."""
        gone = RuntimeError("the server is shutting down")
        for request in self._requests.values():
            request.emit(gone)
        while not self._inbox.empty():
            item = self._inbox.get()
            if item is not None:
                item[1](gone)
        self._send()


def _deliver(answers: list[tuple[asyncio.Queue, Update | list[Scored] | Exception, object]]) -> None:
    for queue_, answer, _ in answers:
        queue_.put_nowait(answer)


@dataclass
class _Request:
    """One generation request in the decoder: its row, and the text its tokens release."""

    job: GenerationRequest
    emit: Emit
    text: TextStream
    row: Row = field(init=False)
    piece: str = ""

    def add(self, token: int) -> bool:
        """The row's ``stop``: take a token's text; True when a stop string ends the text."""
        piece, stopped = self.text.add(token)
        self.piece += piece
        return stopped

    def take(self, token: int) -> None:
        """After the decoder's step: send what the token released, and the end if it was the last."""
        row = self.row
        if row.finish == "cancelled":
            return
        piece, self.piece = self.piece, ""
        if row.finish is not None:
            piece += self.text.rest()
        if piece or row.finish:
            ids = tuple(row.tokens) if row.finish else ()
            self.emit(Update(piece, row.finish, len(row.tokens), ids))


class Stats:
    """What ``/metrics`` reports: counters since the start and the tokens of the last minute."""

    WINDOW = 60.0

    def __init__(self):
        self.started = time.monotonic()
        self.prompt_tokens = 0
        self.generated = 0
        self.steps = 0
        self.recent: deque[tuple[float, int]] = deque()

    def count(self, made: list) -> None:
        now = time.monotonic()
        self.steps += 1
        self.generated += len(made)
        self.recent.append((now, len(made)))
        while self.recent and self.recent[0][0] < now - self.WINDOW:
            self.recent.popleft()

    def render(self, waiting: int, running: int) -> str:
        recent = list(self.recent)
        span = min(self.WINDOW, time.monotonic() - self.started) or 1.0
        rate = sum(n for _, n in recent) / span
        lines = [
            ("kiln_requests_waiting", "gauge", "Requests waiting for a row of the batch.", waiting),
            ("kiln_requests_running", "gauge", "Requests being decoded (rows of the batch).", running),
            ("kiln_prompt_tokens_total", "counter", "Prompt tokens of the requests taken.", self.prompt_tokens),
            ("kiln_generation_tokens_total", "counter", "Tokens generated.", self.generated),
            ("kiln_decode_steps_total", "counter", "Steps of the decoder that made tokens.", self.steps),
            ("kiln_generation_tokens_per_second", "gauge", "Tokens generated a second over the last minute.", rate),
        ]
        return "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v:g}\n" for n, t, h, v in lines)


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
