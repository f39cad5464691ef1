"""Experiment (session 14): can `staged` win ResNet-50's 1x1 layers at 14x14 and 7x7 with deeper chunks?

`candidate_configs` stages at most 16 input channels per chunk; on a 1x1 layer a 2x4 tile's chunk is
then 16 x 8 positions x 32 images (16 KB) for ~1.6 non-zeros per output channel, so each chunk's
two barriers and copy latency dominate (`...-s14-split-probe-edc7a91.jsonl`: 0.150 against 0.080 ms
for `direct` on layer3.1.conv1). Here chunk_c 32 and 64 (a 1x1 halo is the tile itself, so the
stages stay small), 4 or 8 warps, 4-16 rows per warp, tiles 2x4 and 4x4, against `direct` "batch"
(its auto configs) and cuDNN, batch-innermost input and output, DLMC masks at 0.9, N=32.
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-23-s14-staged-1x1-probe.py OUT.jsonl
"""
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from sparsecnn.autotune import benchmark
from sparsecnn.backends import get_backend
from sparsecnn.bench.env import environment
from sparsecnn.bench.patterns import make_weight
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.codegen import staged
from sparsecnn.kernels.reference import reference_conv, relative_error
from sparsecnn.kernels.triton import direct_conv
from sparsecnn.layers import get_suite

TIMING = dict(warmup_ms=25, rep_ms=100, hide_launch=True)
LAYERS = ("layer3.1.conv1", "layer3.1.conv3", "layer4.1.conv1", "layer4.1.conv3", "layer3.0.downsample.0",
          "layer2.1.conv1")


def _time(fn):
    return round(benchmark(fn, torch.device("cuda"), **TIMING)["median_ms"], 4)


def main():
    torch.backends.cudnn.allow_tf32 = False
    env = {**environment("cuda"), "kind": "experiment", "experiment": "staged 1x1 deep chunks", "dtype": "fp32",
           "N": 32, "sparsity": 0.9, "pattern": "dlmc-magnitude_pruning"}
    specs = {spec.name: spec.with_batch(32) for spec in get_suite("resnet50")}
    with open(sys.argv[1], "a") as out:
        for name in LAYERS:
            spec = specs[name]
            weight, _ = make_weight(spec, 0.9, "dlmc-magnitude_pruning", 0, "cuda")
            x = torch.randn(spec.input_shape, device="cuda")
            ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
            xi = batch_inner_view(x.shape, x.dtype, x.device).copy_(x)
            oi = batch_inner_view(spec.output_shape, x.dtype, x.device)
            row = {"layer": name, "cudnn_ms": _time(lambda: F.conv2d(x, weight, None, spec.stride, spec.padding))}
            backend = get_backend("direct")
            row["direct_ms"] = min(
                _time(lambda: direct_conv.direct_conv2d(xi, packed, None, spec.stride, spec.padding, config, out=oi))
                for config in backend.auto_configs(spec, torch.float32) if config.variant == "batch"
                for packed in [backend.prepare(weight, config)])
            times, worst = {}, 0.0
            for (tile_h, tile_w), chunk_c, rows, warps in itertools.product(((2, 4), (4, 4)), (16, 32, 64), (4, 8, 16),
                                                                             (4, 8)):
                try:
                    config = staged.StagedConfig(tile_h, tile_w, chunk_c, rows, warps, "batch_inner")
                    staged.check_layer(spec, config)
                except ValueError:
                    continue
                packed = staged.pack_weight(weight, config)
                if staged.shared_bytes(spec, config, packed.max_segment) > staged.MAX_SMEM_BYTES:
                    continue
                run = lambda: staged.staged_conv2d(xi, packed, spec.stride, spec.padding, config, out=oi)  # noqa: E731
                worst = max(worst, relative_error(run(), ref))
                times[f"{tile_h}x{tile_w} c{chunk_c} r{rows} w{warps}"] = _time(run)
            best = min(times, key=times.get)
            row.update(staged_best=times[best], staged_best_config=best, staged_max_rel_err=worst, staged=times)
            print(json.dumps({k: v for k, v in row.items() if k != "staged"}), flush=True)
            out.write(json.dumps({**env, **row}) + "\n")


if __name__ == "__main__":
    main()
