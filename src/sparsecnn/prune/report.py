"""Per-layer sparsity of a model, as rows and as a markdown table."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from sparsecnn.prune.magnitude import prunable_layers


def _row(layer: str, shape, numel: int, nnz: int) -> dict:
    return {
        "layer": layer,
        "shape": shape,
        "numel": numel,
        "nnz": nnz,
        "sparsity": 1.0 - nnz / numel if numel else 0.0,
    }


def sparsity_report(
    model: nn.Module, masks: Optional[Dict[str, torch.Tensor]] = None
) -> List[dict]:
    """Rows {"layer", "shape", "numel", "nnz", "sparsity"} for each Conv1d/Conv2d/Linear
    weight, in `named_modules()` order, then a "total" row (shape None).

    Without `masks`, nnz counts the non-zero weights. With `masks` ({module path: bool
    tensor}), only those layers are reported and nnz counts the set mask entries.
    """
    layers = prunable_layers(model, include_linear=True)
    if masks is not None:
        layers = [(name, module) for name, module in layers if name in masks]
    rows = []
    for name, module in layers:
        weight = module.weight.detach()
        support = masks[name] if masks is not None else weight
        nnz = int(torch.count_nonzero(support))
        rows.append(_row(name, tuple(weight.shape), weight.numel(), nnz))
    total_numel = sum(row["numel"] for row in rows)
    rows.append(_row("total", None, total_numel, sum(row["nnz"] for row in rows)))
    return rows


def format_sparsity_report(rows: List[dict]) -> str:
    """Markdown table of `sparsity_report` rows; shapes as KxCxRxS, sparsity to 4 places."""
    lines = ["| layer | shape | numel | nnz | sparsity |", "|---|---|---:|---:|---:|"]
    for row in rows:
        shape = "x".join(map(str, row["shape"])) if row["shape"] is not None else ""
        lines.append(
            f"| {row['layer']} | {shape} | {row['numel']} | {row['nnz']} | {row['sparsity']:.4f} |"
        )
    return "\n".join(lines)
