"""The main job, end to end: prune resnet18-cifar to 90%, sparsify it, check it, time it."""
from __future__ import annotations

import copy

import torch

from .autotune import benchmark
from .bench.layers import precision
from .kernels.reference import relative_error
from .models import build_model, default_input_shape
from .nn import SparseConv2d, sparsify_
from .prune import format_sparsity_report, prune_magnitude_, sparsity_report


def _layer_table(model: torch.nn.Module) -> str:
    lines = ["| layer | density | backend | time ms | dense ms | speedup |", "|---|---|---|---|---|---|"]
    for name, module in model.named_modules():
        if isinstance(module, SparseConv2d) and module.timings:
            chosen = min(module.timings.values())
            dense = module.timings["dense"]
            lines.append(f"| {name} | {module.density:.3f} | {module.backend} | {chosen:.4f} | {dense:.4f} | "
                         f"{dense / chosen:.2f}x |")
    return "\n".join(lines)


def run_demo(model_name: str = "resnet18-cifar", sparsity: float = 0.9, batch: int | None = None,
             device: str | None = None, seed: int = 0) -> dict:
    """Prune, sparsify (backend auto), verify against the dense masked model and time both.

    Returns {"rel_err", "dense_ms", "sparse_ms", "speedup", "device"}; prints the report.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch = batch or (32 if device == "cuda" else 8)
    torch.manual_seed(seed)
    model = build_model(model_name).eval().to(device)
    prune_magnitude_(model, sparsity)
    print(f"## {model_name}, magnitude-pruned to {sparsity:.0%}, batch {batch}, fp32 (TF32 off), on {device}\n")
    print(format_sparsity_report(sparsity_report(model)) + "\n")
    x = torch.randn(batch, *default_input_shape(model_name), device=device)
    with torch.no_grad(), precision("fp32"):
        reference = copy.deepcopy(model).double()(x.double())
        sparse = sparsify_(copy.deepcopy(model), x, backend="auto")
        rel_err = relative_error(sparse(x), reference)
        dense_ms = benchmark(lambda: model(x), device)["median_ms"]
        sparse_ms = benchmark(lambda: sparse(x), device)["median_ms"]
    print(_layer_table(sparse) + "\n")
    print(f"relative error vs the dense masked model (fp64): {rel_err:.2e}")
    print(f"end to end: dense {dense_ms:.3f} ms, sparse {sparse_ms:.3f} ms, speedup {dense_ms / sparse_ms:.2f}x")
    if device == "cpu":
        print("note: no GPU here, so these are CPU timings; on a GPU the backends are measured on the GPU.")
    return dict(rel_err=rel_err, dense_ms=dense_ms, sparse_ms=sparse_ms, speedup=dense_ms / sparse_ms,
                device=device)
