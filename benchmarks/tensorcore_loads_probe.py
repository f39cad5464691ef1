"""Probe (issue 45): the `tensorcore` kernel's two load paths on ResNet-50's DLMC layers, fp16,
against cuDNN fp16 NHWC (bias fused) in the same run: "pointer" (rows of flattened pixels gathered
by address) and "tma" (spatial tiles through the tensor memory accelerator, stride-1 layers) at
several launches and packings; and, once, an empty Triton kernel in the same harness (backend
"empty-kernel": the fixed time any one-kernel layer pays here, launch and L2 refill after the
flush). One JSON line per timing; the probe prints each.

Usage: python benchmarks/tensorcore_loads_probe.py OUT.jsonl BATCH [LAYER,...|all]
"""
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.backends.tensorcore.tma_kernel import tma_shape_ok
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS, get_suite
from sparsecnn.tuning.timing import benchmark

PATTERN = "tiles64x32i-dlmc-magnitude_pruning"
POINTER_LAUNCHES = ((64, 4, 3), (128, 4, 3))
TMA_LAUNCHES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3))

out_path, batch = sys.argv[1], int(sys.argv[2])
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else list(DLMC_STUDY_LAYERS)
dtype = torch.float16
torch.backends.cudnn.benchmark = True
device = torch.device("cuda")
base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50", "dtype": "fp16",
        "sparsity": 0.9, "mode": "gpu", "pattern": PATTERN}
specs = {s.name: s for s in get_suite("resnet50", batch)}
out = open(out_path, "a")


@triton.jit
def _empty_kernel(y_ptr):
    tl.store(y_ptr + tl.program_id(0), 0.0)


def emit(spec, backend, config, timing, err, extra=None):
    row = {**base, "layer": spec.name, "N": spec.N, "C": spec.C, "K": spec.K, "H": spec.H, "W": spec.W,
           "R": spec.R, "S": spec.S, "stride": spec.stride[0], "padding": spec.padding[0],
           "backend": backend, "config": config, **timing, "rel_err": err, **(extra or {})}
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(f"{spec.name:22s} {backend:11s} {timing['median_ms'] * 1e3:7.1f} us err {err:.1e} {config}")


sink = torch.empty(1, device=device)
emit(specs[wanted[0]], "empty-kernel", None,
     benchmark(lambda: _empty_kernel[(1,)](sink), device, hide_launch=True), float("nan"))
for name in wanted:
    spec = specs[name]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(device, dtype).contiguous(
        memory_format=torch.channels_last)
    bias = torch.randn(spec.K, generator=gen).to(device, dtype)
    weight = make_weight(spec, 0.9, PATTERN, 0, "cpu")[0].to(device, dtype)
    ref = F.conv2d(x.double(), weight.double(), bias.double(), spec.stride, spec.padding)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    for with_bias in (True, False):
        dense = lambda: F.conv2d(x, w_cl, bias if with_bias else None, spec.stride, spec.padding)
        emit(spec, "cudnn", {"bias": with_bias}, benchmark(dense, device, hide_launch=True),
             relative_error(dense(), ref) if with_bias else float("nan"))
    for group, chunk in ((64, 32), (32, 32), (64, 64)):
        packed = pack_units(weight, group, chunk, "index")
        counts = (packed.group_start[1:] - packed.group_start[:-1]).tolist()
        extra = {"units": packed.num_units, "max_group_units": max(counts)}
        launches = [("pointer", *launch) for launch in POINTER_LAUNCHES]
        if tma_shape_ok(spec.C, spec.K, spec.stride, 2, chunk, group):
            launches += [("tma", *launch) for launch in TMA_LAUNCHES]
        for loads, block_m, warps, stages in launches:
            config = TensorCoreConfig(group, chunk, block_m, warps, stages, order="index", loads=loads)
            fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config, bias=bias)
            emit(spec, "tensorcore", dataclasses.asdict(config), benchmark(fn, device, hide_launch=True),
                 relative_error(fn(), ref), extra)
