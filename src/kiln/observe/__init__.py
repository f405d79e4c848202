"""Seeing a run: metrics to the console, metrics.jsonl and TensorBoard."""

from kiln.observe.metrics import MetricsLogger, NullLogger, format_duration

__all__ = ["MetricsLogger", "NullLogger", "format_duration"]
