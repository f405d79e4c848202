"""Parsing the config values that are written as text with units: durations and step ranges."""

from __future__ import annotations

import re

_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "5m", "1.5h" or "1h30m"; ValueError otherwise."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def parse_step_range(text: str) -> tuple[int, int]:
    """(start, end) of "START:END" (1-based, inclusive) or of a single step "N"."""
    parts = text.split(":")
    try:
        start, end = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        start, end = 0, 0
    if not 1 <= start <= end:
        raise ValueError(f"{text!r} is not a step range START:END with 1 <= START <= END, e.g. 5:8")
    return start, end
