"""Probe (issue 45): the `tensorcore` pointer kernel's launch on ResNet-50's DLMC layers, fp16 or
bf16, against cuDNN NHWC (bias fused) in the same run: block_m x num_warps x num_stages x unroll
(units per loop iteration) for the (64, 32) and (32, 32) index-order packings of the channel-run
tiles. What `auto_configs` keeps rests on it. One JSON line per timing; the probe prints each.

Usage: python benchmarks/tensorcore_launch_probe.py OUT.jsonl BATCH DTYPE [LAYER,...|all]
"""
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS, get_suite
from sparsecnn.tuning.timing import benchmark

PATTERN = "tiles64x32i-dlmc-magnitude_pruning"
LAUNCHES = {  # packing (group, chunk) -> (block_m, num_warps, num_stages, unroll) launches
    (64, 32): ((64, 4, 3, 1), (64, 4, 4, 1), (64, 4, 5, 1), (64, 4, 3, 2), (64, 4, 4, 2), (64, 4, 3, 4),
               (32, 4, 3, 2), (32, 4, 4, 1), (128, 4, 3, 2), (128, 8, 3, 2), (128, 8, 4, 2)),
    (32, 32): ((64, 4, 3, 1), (64, 4, 3, 2), (64, 4, 4, 2), (32, 4, 3, 2)),
}

out_path, batch, dtype_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
wanted = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "all" else list(DLMC_STUDY_LAYERS)
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
torch.backends.cudnn.benchmark = True
device = torch.device("cuda")
base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50", "dtype": dtype_name,
        "sparsity": 0.9, "mode": "gpu", "pattern": PATTERN}
specs = {s.name: s for s in get_suite("resnet50", batch)}
out = open(out_path, "a")


def emit(spec, backend, config, timing, err, extra=None):
    row = {**base, "layer": spec.name, "N": spec.N, "C": spec.C, "K": spec.K, "H": spec.H, "W": spec.W,
           "R": spec.R, "S": spec.S, "stride": spec.stride[0], "padding": spec.padding[0],
           "backend": backend, "config": config, **timing, "rel_err": err, **(extra or {})}
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(f"{spec.name:22s} {backend:10s} {timing['median_ms'] * 1e3:7.1f} us err {err:.1e} {config}", flush=True)


for name in wanted:
    spec = specs[name]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(device, dtype).contiguous(
        memory_format=torch.channels_last)
    bias = torch.randn(spec.K, generator=gen).to(device, dtype)
    weight = make_weight(spec, 0.9, PATTERN, 0, "cpu")[0].to(device, dtype)
    ref = F.conv2d(x.double(), weight.double(), bias.double(), spec.stride, spec.padding)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    dense = lambda: F.conv2d(x, w_cl, bias, spec.stride, spec.padding)
    emit(spec, "cudnn", {"bias": True}, benchmark(dense, device, hide_launch=True), relative_error(dense(), ref))
    for (group, chunk), launches in LAUNCHES.items():
        packed = pack_units(weight, group, chunk, "index")
        counts = (packed.group_start[1:] - packed.group_start[:-1]).tolist()
        extra = {"units": packed.num_units, "max_group_units": max(counts)}
        for block_m, warps, stages, unroll in launches:
            config = TensorCoreConfig(group, chunk, block_m, warps, stages, order="index", unroll=unroll)
            fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config, bias=bias)
            emit(spec, "tensorcore", dataclasses.asdict(config), benchmark(fn, device, hide_launch=True),
                 relative_error(fn(), ref), extra)
