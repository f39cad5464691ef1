"""Experiment (session 11): fp32 ResNet-50 layers on tensor cores (3xTF32) against `direct` and cuDNN.

At N=32 the `direct` "batch" kernel runs at ~7% of the FP32 FMA peak on the 3x3 layers: every FMA
gathers its input element from L1/L2 (a scalar weight has no register reuse), so L2 bandwidth
bounds it. A GEMM on tensor cores reuses each input element across a tile of output channels.
`blocks` with t2 = 1 puts every non-zero of a row group into its dense part: each tile of
BLOCK_M output channels is an implicit GEMM over the union of its rows' non-zero columns, in 3xTF32
(fp32-level error), with no sparse remainder. This times, per layer at N=32, fp32 (TF32 off):
cuDNN fp32 and TF32 (the `precision` baselines), `direct` with the configs `auto` tries, and
`blocks` t2 = 1 in three tile shapes, on the DLMC 0.9 weight and on the same layer's dense weight
(what the skipped columns are worth). GPU time, L2 flushed. One JSON line per measurement.
Usage: python benchmarks/experiments/2026-11-22-s11-tensor-core-fp32.py --out FILE [--layers a,b]
"""
from __future__ import annotations

import argparse
import json

import torch

from sparsecnn.backends import config_to_dict, get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import _backend_fn, _baseline_rows, _prepare_layer, _row, _Run, _try_measure
from sparsecnn.bench.roofline import measure_ceilings
from sparsecnn.kernels.configs import pow2_at_least
from sparsecnn.kernels.triton.blocks_conv import BlocksConfig
from sparsecnn.layers import get_suite

LAYERS = ("conv1,layer1.0.conv2,layer1.0.conv3,layer2.0.conv2,layer2.1.conv1,layer2.1.conv2,layer2.1.conv3,"
          "layer3.0.downsample.0,layer3.1.conv1,layer3.1.conv2,layer3.1.conv3,layer4.1.conv1,layer4.1.conv2,"
          "layer4.1.conv3")
TILES = ((64, 64, 4), (128, 64, 8), (64, 128, 8))  # (block_m, block_n, num_warps)


def _blocks_configs(channels: int):
    tile_rows = max(16, pow2_at_least(channels))
    return list(dict.fromkeys(BlocksConfig(1, min(m, tile_rows), n, 32, warps, 3, "tf32x3")
                              for m, n, warps in TILES))


def _measure_backend(run: _Run, layer, backend, config, label: str):
    stats = _try_measure(lambda: _backend_fn(backend, layer, "fp32", config), layer, run, "fp32", label)
    if stats is None:
        return None
    return _row(layer, run, backend.name, "fp32", {**config_to_dict(config), "weight": label}, stats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", default=LAYERS)
    args = parser.parse_args()
    device = torch.device("cuda")
    timing = {"warmup_ms": 10.0, "rep_ms": 50.0, "hide_launch": True}
    base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50", "model": None,
            "mode": "gpu"}
    run = _Run({**base, "sparsity": 0.9}, "dlmc-magnitude_pruning", "fp32", device, 0, timing,
               measure_ceilings(device), "auto", print)
    dense_run = _Run({**base, "sparsity": 0.0}, "random", "fp32", device, 0, timing, run.ceilings, "auto", print)
    direct, blocks = get_backend("direct"), get_backend("blocks")
    wanted = args.layers.split(",")
    with open(args.out, "a") as out:
        for spec in get_suite("resnet50", args.batch):
            if spec.name not in wanted:
                continue
            layer = _prepare_layer(spec, spec.name, 0.9, run)
            rows = [r for r in _baseline_rows(layer, run) if r["dtype"] in ("fp32", "tf32")]
            rows += [_measure_backend(run, layer, direct, c, "dlmc") for c in direct.auto_configs(spec, torch.float32)]
            rows += [_measure_backend(run, layer, blocks, c, "dlmc") for c in _blocks_configs(spec.K)]
            dense_layer = _prepare_layer(spec, spec.name, 0.0, dense_run)
            rows += [_measure_backend(dense_run, dense_layer, blocks, c, "dense") for c in _blocks_configs(spec.K)]
            for row in filter(None, rows):
                out.write(json.dumps(row) + "\n")
                print(f"{spec.name:24s} {row['backend']:7s} {row['dtype']:5s} {row['median_ms']:.4f} ms "
                      f"err {row['rel_err']:.1e} {json.dumps(row['config'])[:100]}")
            out.flush()


if __name__ == "__main__":
    main()
