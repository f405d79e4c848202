"""Seeing a run: metric sinks (console, metrics.jsonl, TensorBoard, W&B), the step profiler,
``kiln report`` and memory telemetry."""

from kiln.observe.metrics import MetricsLogger, NullLogger, format_duration, open_logger

__all__ = ["MetricsLogger", "NullLogger", "format_duration", "open_logger"]
