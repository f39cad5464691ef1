"""Benchmarks: per-layer and whole-model timing against cuDNN, the JSON-lines results schema, reports.

Layering: `bench` uses every package below it; only the CLI imports `bench`.
"""
from sparsecnn.bench.env import environment
from sparsecnn.bench.layers import bench_layers
from sparsecnn.bench.models import bench_model
from sparsecnn.bench.report import markdown_table, plot_model_speedups, plot_results, plot_speedups, render_report
from sparsecnn.bench.schema import FIELDS, read_jsonl, validate_row, write_jsonl

__all__ = [
    "FIELDS",
    "bench_layers",
    "bench_model",
    "environment",
    "markdown_table",
    "plot_model_speedups",
    "plot_results",
    "plot_speedups",
    "read_jsonl",
    "render_report",
    "validate_row",
    "write_jsonl",
]
