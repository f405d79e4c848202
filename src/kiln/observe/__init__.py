"""Seeing a run: metrics to the console, metrics.jsonl and TensorBoard."""

from kiln.observe.metrics import MetricsLogger, format_duration

__all__ = ["MetricsLogger", "format_duration"]
