"""Turning a run into artifacts people load elsewhere: ``kiln export RUN --format hf`` (hf.py)."""

from kiln.export.hf import export_hf

__all__ = ["export_hf"]
