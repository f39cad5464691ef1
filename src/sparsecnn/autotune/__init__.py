"""Measured choice among backends (the full per-layer autotuner builds on this)."""
from .select import Candidate, pick_fastest
from .timing import benchmark

__all__ = ["Candidate", "benchmark", "pick_fastest"]
