"""Probe (issue 45): the `tensorcore` pointer kernel's launch on ResNet-50's DLMC layers, fp16 or
bf16, against cuDNN NHWC (bias fused) in the same run: block_m x num_warps x num_stages x unroll
(units per loop iteration) for the (64, 32) and (32, 32) index-order packings of the channel-run
tiles. What `auto_configs` keeps rests on it. One JSON line per timing; the probe prints each.

Usage: python benchmarks/tensorcore_launch_probe.py OUT.jsonl BATCH DTYPE [LAYER,...|all]
"""
import dataclasses
import sys

import torch
from tensorcore_probe_rows import ProbeRows, unit_counts

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS
from sparsecnn.tuning.timing import benchmark

LAUNCHES = {  # packing (group, chunk) -> (block_m, num_warps, num_stages, unroll) launches
    (64, 32): ((64, 4, 3, 1), (64, 4, 4, 1), (64, 4, 5, 1), (64, 4, 3, 2), (64, 4, 4, 2), (64, 4, 3, 4),
               (32, 4, 3, 2), (32, 4, 4, 1), (128, 4, 3, 2), (128, 8, 3, 2), (128, 8, 4, 2)),
    (32, 32): ((64, 4, 3, 1), (64, 4, 3, 2), (64, 4, 4, 2), (32, 4, 3, 2)),
}

out_path, batch, dtype_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
wanted = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "all" else list(DLMC_STUDY_LAYERS)
torch.backends.cudnn.benchmark = True
device = torch.device("cuda")
rows = ProbeRows(out_path, batch, {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name], dtype_name, device)

for name in wanted:
    spec, x, bias, weight, ref = rows.layer(name)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    dense = lambda: torch.nn.functional.conv2d(x, w_cl, bias, spec.stride, spec.padding)
    rows.emit(spec, "cudnn", {"bias": True}, benchmark(dense, device, hide_launch=True), relative_error(dense(), ref))
    for (group, chunk), launches in LAUNCHES.items():
        packed = pack_units(weight, group, chunk, "index")
        extra = unit_counts(packed)
        for block_m, warps, stages, unroll in launches:
            config = TensorCoreConfig(group, chunk, block_m, warps, stages, order="index", unroll=unroll)
            fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config, bias=bias)
            rows.emit(spec, "tensorcore", dataclasses.asdict(config), benchmark(fn, device, hide_launch=True),
                      relative_error(fn(), ref), extra)
