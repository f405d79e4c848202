"""kiln's model as a language model of EleutherAI's lm-evaluation-harness.

``KilnLM`` answers lm-eval's three kinds of request with any kiln model that returns next-token
logits from ``model(tokens)`` (kiln's GPT, a Hugging Face causal LM, either with LoRA adapters,
a sharded run gathered by ``load_run`` or sharded over ranks that all run the same requests):

* ``loglikelihood``: lm-eval's own ``TemplateLM`` splits context and continuation into tokens
  exactly as its ``hf`` model does; the pairs are scored longest first, in batches padded on the
  right (a causal model's earlier logits do not see the padding), each in one forward pass.
* ``loglikelihood_rolling``: each text in lm-eval's rolling windows of the model's context,
  the first conditioned on the end-of-text token, as ``kiln eval --data`` scores a document.
* ``generate_until``: every request a row of kiln's batched decoder (greedy unless the task asks
  to sample), stopped and cut at the task's stop strings or end-of-text.

lm-eval imports slowly and is an optional extra (``kiln[eval]``): import this module only when
tasks are asked for.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from kiln.data.tokenizer import Codec
from kiln.models.decode import Decoder, Row, Sampling


class KilnLM(TemplateLM):
    def __init__(
        self,
        model: nn.Module,
        family: Any,
        tokenizer: Any,
        max_length: int,
        batch_size: int = 8,
        max_gen_toks: int = 256,
    ):
        super().__init__()
        self.model, self.family, self.tokenizer = model, family, tokenizer
        # A transformers tokenizer or kiln's own, told apart and decoded as kiln generate does.
        self.codec = Codec(tokenizer)
        self.hf, self._eot = self.codec.hf, self.codec.eos_id
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self._device = next(model.parameters()).device
        self._prefix_text = tokenizer.decode([self.prefix_token_id]) if self.hf else ""

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        """What an empty context, and each rolling text, starts from: as in lm-eval's hf model,
        the tokenizer's beginning-of-sequence token if it has one, else end-of-text."""
        bos = self.tokenizer.bos_token_id if self.hf else None
        return self._eot if bos is None else bos

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        if self.hf:
            # As lm-eval's hf model: the tokenizer's own special tokens (a Llama's BOS), unless
            # the text already starts with the prefix token.
            starts = string.startswith(self._prefix_text)
            return self.tokenizer.encode(string, add_special_tokens=not starts)
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.codec.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether each of its tokens is the
        greedy choice) for each ``(key, context tokens, continuation tokens)``, in order.

        Requests whose model inputs are the same tokens (the choices of a multiple-choice
        question that are one token each) share one row of one forward pass, as lm-eval's hf
        model shares them; the rows run longest first, in batches padded on the right."""
        # The last max_length tokens before each continuation token; the final token is only
        # ever a target.
        inputs = [tuple((context + continuation)[-(self.max_length + 1) : -1]) for _, context, continuation in requests]
        users: dict[tuple[int, ...], list[int]] = {}
        for index, x in enumerate(inputs):
            users.setdefault(x, []).append(index)
        rows = sorted(users, key=lambda x: (-len(x), x))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for at in range(0, len(rows), self.batch_size):
            batch = rows[at : at + self.batch_size]
            tokens = torch.full((len(batch), len(batch[0])), self._eot, dtype=torch.long)
            for i, x in enumerate(batch):
                tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            with torch.no_grad():
                logprobs = F.log_softmax(self._logits(tokens.to(self._device)).float(), dim=-1).cpu()
            for i, x in enumerate(batch):
                for index in users[x]:
                    continuation = requests[index][2]
                    scores = logprobs[i, len(x) - len(continuation) : len(x)]
                    wanted = torch.tensor(continuation, dtype=torch.long)
                    total = float(scores.gather(-1, wanted[:, None]).sum())
                    results[index] = (total, bool((scores.argmax(-1) == wanted).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append(((text, ""), context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation: all requests rows of one batch of the decoder (up to
        batch_size running at once, whatever their prompts' lengths), each row stopped at
        end-of-text or a stop string and cut there. A request that samples draws from a seed
        taken from torch's generator (which lm-eval seeds) plus its place: reproducible, and the
        same on every rank of a sharded model, whose ranks must decode the same tokens."""
        decodable = self.family.decoding(self.model)
        if decodable is None:
            raise ValueError(f"this model ({type(self.model).__name__}) cannot generate text")
        seed = int(torch.randint(2**62, (1,)).item())
        rows, untils = [], []
        for i, (context, gen_kwargs) in enumerate(request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            # No end-of-text string among the stops: decoding stops at the token itself.
            until = list(handle_stop_sequences(kwargs.pop("until", None), eos=None))
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            # As lm-eval's hf model: the context cut on the left to leave room for the answer.
            room = self.max_length - max_gen_toks if max_gen_toks < self.max_length else self.max_length
            prompt = self.tok_encode(context)[-room:] or [self.prefix_token_id]
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            row = Row(prompt, max_gen_toks, Sampling(temperature=temperature, seed=seed + i), self._eot)
            row.stop = self._stopper(row, until)
            rows.append(row)
            untils.append(until)
        Decoder(decodable, max_batch=self.batch_size).run(rows)
        return [
            postprocess_generated_text(
                self.tok_decode([t for t in row.tokens if t != self._eot]), stop=until, think_end_token=None
            )
            for row, until in zip(rows, untils, strict=True)
        ]

    def _stopper(self, row: Row, until: list[str]):
        """The row's ``stop``: whether a stop string has just been completed, which lies in its
        last tokens (each at least one character, a few more for a character split over byte
        tokens)."""
        tail = max((len(stop) for stop in until), default=0) + 4

        def stop(token: int) -> bool:
            return bool(until) and any(s in self.tok_decode(row.tokens[-tail:]) for s in until)

        return stop

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            return self.model(tokens)
        finally:
            self.model.train(was_training)
