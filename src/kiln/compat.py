"""Quiet imports of the libraries kiln loads on demand (torchao, peft, transformers), and quiet
calls of one into another.

Importing torchao logs, through Python logging, to every run's output:

- "Failed to load .../torchao/_C*.so: ..." (or "Skipping import of cpp extensions ...") when its
  optional C++ kernels were built for another torch or GPU. kiln uses none of them (float8
  training, NF4 and int8 quantization run on torch's own operators), so there is nothing to act on;
- torch's "<enum ...> is an Enum subclass and is now natively supported by torch.compile ...
  register_constant() ... deprecated" for each enum torchao registers with pytree.

transformers imports torchao when it loads a model, and peft imports it too, so a run shows these
lines whether or not it uses torchao itself.

``quiet_library_imports()`` drops exactly those records, by their logger and text, before such an
import; everything else those libraries log, and all of kiln's own messages, still show.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# logger name -> how the messages dropped from it start (the unformatted message, ``record.msg``)
_NOISE = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported by torch.compile",),
}


class _DropImportNoise(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_library_imports() -> None:
    """Filter the import noise above out of those libraries' loggers (once; idempotent)."""
    for name, starts in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) for f in logger.filters):
            logger.addFilter(_DropImportNoise(starts))


@contextlib.contextmanager
def quiet_library_warnings() -> Iterator[None]:
    """Within: no warning that one library gives about how another calls it, which a kiln user
    can do nothing about (peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing``
    in ``get_peft_model``, a FutureWarning on every LoRA run)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
