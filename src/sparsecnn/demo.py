"""The main job, end to end: prune resnet18-cifar to 90%, sparsify it, check it, time it."""
from __future__ import annotations

import copy
import math
from typing import List, Optional, Tuple

import torch

from sparsecnn.bench.layers import precision
from sparsecnn.core.reference import relative_error
from sparsecnn.models import build_model, default_input_shape
from sparsecnn.nn import SparseConv2d
from sparsecnn.passes import prepare_for_inference
from sparsecnn.prune import format_sparsity_report, prune_magnitude_, sparsity_report
from sparsecnn.tuning import Candidate, LayerResult, benchmark
from sparsecnn.tuning.select import BASELINE
from sparsecnn.tuning.sparsify import sparsify_


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def _measured(value: Optional[float]) -> Optional[float]:
    """`value` if it is a measured time, None when missing (nan: not measured)."""
    return None if value is None or math.isnan(value) or value <= 0 else value


def _not_timed(layer: LayerResult, label: str) -> str:
    reason = layer.dropped.get(label)
    return f"{label} not timed" + (f" (dropped: {reason})" if reason else " on this layer")


def _layer_row(layer: LayerResult, module: SparseConv2d) -> Tuple[List[str], List[str]]:
    """The table cells of one tuned layer and the reasons for its "-" cells. The time is the
    report's median for the backend the layer runs: its per-layer choice, or the backend the
    whole-model check moved it to (`TuneReport.model_check`)."""
    runs = Candidate(module.backend, module.config).label()
    own_pick = (module.backend, module.config) == (layer.backend, layer.config)
    notes, reasons = [], []
    if own_pick:
        time_ms = _measured(layer.time_ms)
    else:
        time_ms = _measured(layer.times_ms.get(runs))
        alone = _measured(layer.time_ms)
        notes.append(f"set by the whole-model check; its own pick: {layer.choice}"
                     + ("" if alone is None else f", {alone:.4f} ms"))
    if time_ms is None:
        reasons.append(_not_timed(layer, runs))
    dense_ms = _measured(layer.dense_ms)
    if dense_ms is None:
        reasons.append(_not_timed(layer, BASELINE))
    if time_ms is None or dense_ms is None:
        speedup = None
    else:
        speedup = layer.speedup if own_pick else dense_ms / time_ms
    cells = [layer.name, f"{module.density:.3f}", runs, _ms(time_ms), _ms(dense_ms),
             "-" if speedup is None else f"{speedup:.2f}x", "; ".join(notes)]
    return cells, reasons


def _layer_table(model: torch.nn.Module) -> str:
    """Per tuned layer (`model.sparsecnn_report`, call order): the backend it runs, that backend's
    median ms and the dense median ms from tuning, and their ratio; "-" where a time was not
    measured, with the reason under the table."""
    report = model.sparsecnn_report
    lines = ["| layer | density | backend | time ms | dense ms | speedup | note |", "|---|---|---|---:|---:|---:|---|"]
    missing = []
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        if isinstance(module, SparseConv2d):
            cells, reasons = _layer_row(layer, module)
            lines.append("| " + " | ".join(cells) + " |")
            missing += [f"- {layer.name}: {reason}" for reason in reasons]
    lines.append(f"\ntimes: median ms of each layer alone while tuning ({report.policy}, {report.run_mode}); "
                 "speedup = dense ms / time ms")
    return "\n".join(lines + (["\n\"-\": not measured"] + missing if missing else []))


def run_demo(model_name: str = "resnet18-cifar", sparsity: float = 0.9, batch: int | None = None,
             device: str | None = None, seed: int = 0) -> dict:
    """Prune, `prepare_for_inference` + `sparsify_` with the defaults, verify against the dense masked
    model in fp64 and time both (the dense model as given at PyTorch's defaults; on CUDA also exact fp32).

    Returns {"rel_err", "dense_ms", "sparse_ms", "speedup", "device", "model"} (the sparse model,
    its `TuneReport` as `model.sparsecnn_report`); prints the report.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch = batch or (32 if device == "cuda" else 8)
    torch.manual_seed(seed)
    model = build_model(model_name).eval().to(device)
    prune_magnitude_(model, sparsity)
    defaults = "PyTorch's defaults (TF32 convs)" if device == "cuda" else "fp32"
    print(f"## {model_name}, magnitude-pruned to {sparsity:.0%}, batch {batch}, {defaults}, on {device}\n")
    print(format_sparsity_report(sparsity_report(model)) + "\n")
    x = torch.randn(batch, *default_input_shape(model_name), device=device)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())
        sparse = sparsify_(prepare_for_inference(copy.deepcopy(model)), x)  # dtype=None: PyTorch's flags
        rel_err = relative_error(sparse(x), reference)
        dense_ms = benchmark(lambda: model(x), device)["median_ms"]
        sparse_ms = benchmark(lambda: sparse(x), device)["median_ms"]
        with precision("fp32"):  # exact fp32 (TF32 off): the other fp32 baseline
            exact_ms = benchmark(lambda: model(x), device)["median_ms"] if device == "cuda" else None
    print(_layer_table(sparse) + "\n")
    print(f"relative error vs the dense masked model (fp64): {rel_err:.2e}")
    print(f"end to end: dense as given {dense_ms:.3f} ms ({defaults}), sparse {sparse_ms:.3f} ms, "
          f"speedup {dense_ms / sparse_ms:.2f}x")
    if exact_ms is not None:
        print(f"dense exact fp32 (TF32 off) {exact_ms:.3f} ms: {exact_ms / sparse_ms:.2f}x")
    if device == "cpu":
        print("note: no GPU here, so these are CPU timings; on a GPU the backends are measured on the GPU.")
    return dict(rel_err=rel_err, dense_ms=dense_ms, sparse_ms=sparse_ms, speedup=dense_ms / sparse_ms,
                device=device, model=sparse)
