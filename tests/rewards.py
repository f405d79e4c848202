"""Reward functions for the GRPO tests, called as TRL calls them (``grpo.reward = "rewards:NAME"``)."""

from __future__ import annotations

import re


def right_sum(prompts: list[str], completions: list[str], answer: list[int], **_) -> list[float]:
    """1 for a completion whose first number is the answer, else 0."""
    out = []
    for completion, right in zip(completions, answer, strict=True):
        found = re.search(r"-?\d+", completion)
        out.append(1.0 if found and int(found.group()) == right else 0.0)
    return out
