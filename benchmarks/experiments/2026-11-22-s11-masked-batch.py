"""Experiment (session 11): the `direct` "batch" kernel on a batch-innermost input with padding, read
unpadded with masked loads, against padding it first (pack + unmasked kernel).

In a ResNet-50 whose activations stay batch-innermost (nn/layout.py), every padded layer (conv1,
the 3x3 convs) paid a pack of its input, a full read and write of the activation. This times, on
each of those layers at N=32, fp32, DLMC 0.9 weights (random 0.9 where DLMC is not installed),
bias and ReLU fused as in a folded model, input batch-innermost, for each "batch" config `auto`
tries: path "pack" (`padded_batch_inner`, then the kernel on the padded input) and path "masked"
(the kernel on the input as it is, taps outside the image masked). Both run through the launcher
`direct_conv2d_arrays` (codes None forces the pack). GPU time (launch hidden), L2 flushed; relative
error against fp64; whether the two outputs are bitwise equal (same FMAs in the same order).
One JSON line per layer x config x path; then a per-layer summary and each path's total over the
layers (best config per layer).
Usage: python benchmarks/experiments/2026-11-22-s11-masked-batch.py --out FILE [--batch 32] [--layers a,b]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from typing import Dict, List

import torch

from sparsecnn.autotune.timing import benchmark
from sparsecnn.backends import get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.formats import ChunkedCSRWeight
from sparsecnn.kernels.reference import reference_conv, relative_error
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.triton.direct_conv import direct_conv2d_arrays, weight_arrays
from sparsecnn.layers import ConvSpec, get_suite

PATHS = ("pack", "masked")


def layer_rows(spec: ConvSpec, base: dict, pattern: str, device: torch.device) -> List[dict]:
    """One row per (config, path) for `spec` (padded), input batch-innermost on `device`."""
    weight, label = make_weight(spec, 0.9, pattern, 0, device)
    gen = torch.Generator().manual_seed(1)
    x = batch_inner_view(spec.input_shape, torch.float32, device).copy_(torch.randn(spec.input_shape, generator=gen))
    bias = torch.randn(spec.K, generator=gen).to(device)
    ref = reference_conv(x, weight, bias, stride=spec.stride, padding=spec.padding, fp64=True).clamp(min=0)
    (ph, pw), sparsity = spec.padding, float((weight == 0).double().mean())
    configs = [c for c in get_backend("direct").auto_configs(spec, torch.float32) if c.variant == "batch"]
    rows = []
    for config in configs:
        packed = ChunkedCSRWeight.from_dense(weight, config.chunk)
        values, offsets, row_ptr, _, codes = weight_arrays(packed, spec.H + 2 * ph, spec.W + 2 * pw, config, (ph, pw))
        if codes is None:
            print(f"{spec.name}: the masked codes do not fit int32; pack only")
        outputs: Dict[str, torch.Tensor] = {}
        for path, path_codes in zip(PATHS, (None, codes)):
            if path == "masked" and codes is None:
                continue
            fn = functools.partial(direct_conv2d_arrays, x, values, offsets, row_ptr, None, path_codes,
                                   spec.weight_shape, bias, spec.stride, spec.padding, config, relu=True,
                                   out=torch.empty(spec.output_shape, device=device))
            outputs[path] = fn().clone()
            stats = benchmark(fn, device, hide_launch=True)
            shape = {k: getattr(spec, k) for k in ("N", "C", "K", "H", "W", "R", "S")}
            rows.append({**base, "layer": spec.name, **shape, "stride": list(spec.stride),
                         "padding": list(spec.padding), "dtype": "fp32", "sparsity": sparsity, "pattern": label,
                         "backend": "direct", "config": {**dataclasses.asdict(config), "path": path}, "mode": "gpu",
                         **stats, "rel_err": relative_error(outputs[path], ref)})
            print(f"{spec.name:24s} {path:6s} p{config.block_pix} n{config.sub_batch} c{config.chunk} "
                  f"{stats['median_ms']:.4f} ms err {rows[-1]['rel_err']:.1e}")
        if len(outputs) == 2:
            print(f"{spec.name:24s} outputs bitwise equal: {torch.equal(outputs['pack'], outputs['masked'])}")
    return rows


def summary(rows: List[dict], totals: Dict[str, float]) -> None:
    """Print each path's best config on this layer and add it to `totals` (ms per path)."""
    best = {}
    for row in rows:
        path = row["config"]["path"]
        if path not in best or row["median_ms"] < best[path]["median_ms"]:
            best[path] = row
    for path, row in best.items():
        totals[path] = totals.get(path, 0.0) + row["median_ms"]
    text = "  ".join(f"{path} {row['median_ms']:.4f} ms (p{row['config']['block_pix']} c{row['config']['chunk']})"
                     for path, row in best.items())
    ratio = f"  masked/pack {best['masked']['median_ms'] / best['pack']['median_ms']:.3f}" if len(best) == 2 else ""
    print(f"== {rows[0]['layer']:24s} {text}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", default=None, help="comma-separated layer names (default: every padded layer)")
    parser.add_argument("--pattern", default="dlmc-magnitude_pruning")
    args = parser.parse_args()
    device = torch.device("cuda")
    base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50"}
    wanted = None if args.layers is None else set(args.layers.split(","))
    totals: Dict[str, float] = {}
    with open(args.out, "a") as out, torch.no_grad():
        for spec in get_suite("resnet50", args.batch):
            if spec.padding == (0, 0) or (wanted is not None and spec.name not in wanted):
                continue
            rows = layer_rows(spec, base, args.pattern, device)
            for row in rows:
                out.write(json.dumps(row) + "\n")
            out.flush()
            summary(rows, totals)
    for path, ms in totals.items():
        print(f"total {path}: {ms:.3f} ms")
    if len(totals) == 2:
        pack, masked = totals["pack"], totals["masked"]
        print(f"masked saves {pack - masked:.3f} ms per forward ({masked / pack:.3f}x the pack path)")


if __name__ == "__main__":
    main()
