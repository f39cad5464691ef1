"""Probe (issue 45): the `tensorcore` kernel's two load paths on ResNet-50's DLMC layers, fp16,
against cuDNN fp16 NHWC (bias fused) in the same run: "pointer" (rows of flattened pixels gathered
by address) and "tma" (spatial tiles through the tensor memory accelerator, stride-1 layers) at
several launches and packings; and, once, an empty Triton kernel in the same harness (backend
"empty-kernel": the fixed time any one-kernel layer pays here, launch and L2 refill after the
flush). One JSON line per timing; the probe prints each.

Usage: python benchmarks/tensorcore_loads_probe.py OUT.jsonl BATCH [LAYER,...|all]
"""
import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tensorcore_probe_rows import ProbeRows, unit_counts

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.backends.tensorcore.tma_kernel import tma_shape_ok
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS
from sparsecnn.tuning.timing import benchmark

POINTER_LAUNCHES = ((64, 4, 3), (128, 4, 3))
TMA_LAUNCHES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3))

out_path, batch = sys.argv[1], int(sys.argv[2])
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else list(DLMC_STUDY_LAYERS)
torch.backends.cudnn.benchmark = True
device = torch.device("cuda")
rows = ProbeRows(out_path, batch, torch.float16, "fp16", device)


@triton.jit
def _empty_kernel(y_ptr):
    tl.store(y_ptr + tl.program_id(0), 0.0)


sink = torch.empty(1, device=device)
rows.emit(rows.specs[wanted[0]], "empty-kernel", None,
          benchmark(lambda: _empty_kernel[(1,)](sink), device, hide_launch=True), float("nan"))
for name in wanted:
    spec, x, bias, weight, ref = rows.layer(name)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    for with_bias in (True, False):
        dense = lambda: F.conv2d(x, w_cl, bias if with_bias else None, spec.stride, spec.padding)
        rows.emit(spec, "cudnn", {"bias": with_bias}, benchmark(dense, device, hide_launch=True),
                  relative_error(dense(), ref) if with_bias else float("nan"))
    for group, chunk in ((64, 32), (32, 32), (64, 64)):
        packed = pack_units(weight, group, chunk, "index")
        launches = [("pointer", *launch) for launch in POINTER_LAUNCHES]
        if tma_shape_ok(spec.C, spec.K, spec.stride, 2, chunk, group):
            launches += [("tma", *launch) for launch in TMA_LAUNCHES]
        for loads, block_m, warps, stages in launches:
            config = TensorCoreConfig(group, chunk, block_m, warps, stages, order="index", loads=loads)
            fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config, bias=bias)
            rows.emit(spec, "tensorcore", dataclasses.asdict(config), benchmark(fn, device, hide_launch=True),
                      relative_error(fn(), ref), unit_counts(packed))
