"""Benchmarks: per-layer and whole-model timing against cuDNN, the JSON-lines results schema, reports.

Layering: `bench` uses every package below it; only the CLI imports `bench`.
"""
from .env import environment
from .layers import bench_layers
from .models import bench_model
from .report import markdown_table, plot_model_speedups, plot_speedups, render_report
from .schema import FIELDS, read_jsonl, validate_row, write_jsonl

__all__ = [
    "FIELDS",
    "bench_layers",
    "bench_model",
    "environment",
    "markdown_table",
    "plot_model_speedups",
    "plot_speedups",
    "read_jsonl",
    "render_report",
    "validate_row",
    "write_jsonl",
]
