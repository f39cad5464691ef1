"""Probe (issue 45): what the `tensorcore` kernel loses to its permuted epilogue, and how far it is
from its bound, on ResNet-50's layers (DLMC masks re-pruned into tiles, 0.9), fp16 unless DTYPE says.

Per layer and mask PATTERN (default: tiles64x32-dlmc-magnitude_pruning and its index-order twin
tiles64x32i-dlmc-magnitude_pruning): cuDNN NHWC without bias (bench's baseline); the kernel on the
support-order packing as the tuner runs it (stores through the channel map, "support"); the same
packed units storing contiguously in packing order ("support-contiguous": identical MMA work, output
channels permuted, checked against the permuted reference); the index-order packing ("index").
Each row has kept MMA TFLOP/s (units x group x chunk x pixels x 2 / time), cuDNN's dense TFLOP/s and
the roofline floor (bench.roofline). One JSON line per measurement.

Usage: python benchmarks/tensorcore_store_probe.py OUT.jsonl BATCH [DTYPE] [LAYER,...|all] [PATTERN,...]
"""
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.core.reference import relative_error
from sparsecnn.bench.patterns import make_weight
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS, get_suite
from sparsecnn.tuning.timing import benchmark

PACKINGS = ((64, 32), (32, 32))
LAUNCHES = ((64, 4, 3), (128, 4, 3), (128, 8, 3))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

out_path, batch = sys.argv[1], int(sys.argv[2])
dtype_name = sys.argv[3] if len(sys.argv) > 3 else "fp16"
wanted = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "all" else list(DLMC_STUDY_LAYERS)
patterns = (sys.argv[5] if len(sys.argv) > 5 else
            "tiles64x32-dlmc-magnitude_pruning,tiles64x32i-dlmc-magnitude_pruning").split(",")
dtype = DTYPES[dtype_name]
torch.backends.cudnn.benchmark = True
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1 smoke runs
ceilings = measure_ceilings(device)
base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50", "dtype": dtype_name,
        "mode": "gpu", "probe": "tensorcore_store_probe", **ceilings}
specs = {s.name: s for s in get_suite("resnet50", batch)}
out = open(out_path, "a")


def emit(spec, pattern, backend, config, timing, err, flops, density, extra=None):
    ms = timing["median_ms"]
    row = {**base, "layer": spec.name, **spec.as_dict(), "pattern": pattern, "sparsity": 1 - density,
           "backend": backend, "config": config, **timing, "rel_err": err, "TFLOPs": flops / ms / 1e9,
           "floor_ms": floor_ms(spec, density, dtype_name, ceilings), **(extra or {})}
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(f"{spec.name:22s} {pattern[:11]:11s} {backend:20s} {ms:.4f} ms {flops / ms / 1e9:7.1f} TF/s "
          f"floor {row['floor_ms']:.4f} err {err:.1e} {config or ''}", flush=True)


for name in wanted:
    spec = specs[name]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(device, dtype).contiguous(
        memory_format=torch.channels_last)
    M = spec.N * spec.P * spec.Q
    for pattern in patterns:
        weight = make_weight(spec, 0.9, pattern, 0, "cpu")[0].to(device, dtype)
        density = float((weight != 0).float().mean())
        ref = F.conv2d(x.double(), weight.double(), None, spec.stride, spec.padding)
        w_cl = weight.contiguous(memory_format=torch.channels_last)
        fn = lambda: F.conv2d(x, w_cl, None, spec.stride, spec.padding)
        emit(spec, pattern, "cudnn", None, benchmark(fn, device, hide_launch=True), relative_error(fn(), ref),
             2 * M * weight.numel(), density)
        for group, chunk in PACKINGS:
            for order in ("support", "index"):
                packed = pack_units(weight, group, chunk, order)
                variants = [(order, packed, ref)]
                if packed.permuted:
                    rows = packed.out_channel.long()
                    perm = rows[rows >= 0]
                    straight = dataclasses.replace(packed, permuted=False,
                                                   out_channel=torch.arange(rows.numel(), device=device,
                                                                            dtype=torch.int32))
                    variants.append((order + "-contiguous", straight, ref[:, perm]))
                for label, weights, expected in variants:
                    for block_m, warps, stages in LAUNCHES:
                        config = TensorCoreConfig(group, chunk, block_m, warps, stages, order=order)
                        fn = lambda: unit_conv(x, weights, spec.stride, spec.padding, config)
                        flops = 2 * M * weights.num_units * group * chunk
                        emit(spec, pattern, "tensorcore-" + label, dataclasses.asdict(config),
                             benchmark(fn, device, hide_launch=True), relative_error(fn(), expected), flops, density,
                             {"units": weights.num_units})
