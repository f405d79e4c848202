"""A reward function for GRPO (``run.job = "grpo"``), called as TRL calls one:
``grpo.reward = "rewards:right_sum"`` with this folder importable (``PYTHONPATH=examples``).

Records are ``{"prompt": "3 + 4 =", "answer": 7}``; every field besides the prompt reaches the
function as a list, one entry per completion.
"""

from __future__ import annotations

import re


def right_sum(prompts: list[str], completions: list[str], answer: list[int], **_) -> list[float]:
    """1 for a completion whose first number is the answer, else 0."""
    out = []
    for completion, right in zip(completions, answer, strict=True):
        found = re.search(r"-?\d+", completion)
        out.append(1.0 if found and int(found.group()) == right else 0.0)
    return out
