"""Probe (issue 45): ResNet-50's projection shortcuts folded into the block's last conv on tensor cores.

The first block of each stage ends in relu(conv3(y) + downsample(x)): two 1x1 convs whose sum is the
block's output. As tuned today, `tensorcore` runs them as two kernels: the downsample conv writes
its output, and conv3 reads it back as its residual (layer1: 51 MB each way in fp16 at N=32). With
`format.pack_shortcut_units` both weights are one reduction and `unit_conv(..., shortcut=x)` runs
them in one kernel, which writes only the block's output. Per block, in one run, L2 flushed, GPU
time (launches hidden): cuDNN (NHWC, both convs, add and ReLU), our two kernels
("tensorcore-separate") and the one kernel ("tensorcore-shortcut") at each packing the tuner offers
conv3, with the error against fp64. DLMC masks re-pruned into channel-run tiles (0.9) for both
convs. One JSON line per timing (layer: the block's conv3); the last lines summarise.

Usage: python benchmarks/tensorcore_shortcut_probe.py OUT.jsonl BATCH [DTYPE] [BLOCK,...|all] [CONFIGS]
CONFIGS: how many of the tuner's configs for conv3 to time (default all). On the CPU
(TRITON_INTERPRET=1) it runs as a smoke test: one call's wall time, meaningless as a speed.
"""
import dataclasses
import math
import sys

import torch
import torch.nn.functional as F
from tensorcore_probe_rows import ProbeRows, unit_counts

from sparsecnn.backends.tensorcore.format import pack_shortcut_units, pack_units
from sparsecnn.backends.tensorcore.kernel import auto_configs, unit_conv
from sparsecnn.core.reference import relative_error
from sparsecnn.tuning.timing import benchmark

BLOCKS = ("layer1.0", "layer2.0", "layer3.0", "layer4.0")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

out_path, batch = sys.argv[1], int(sys.argv[2])
dtype_name = sys.argv[3] if len(sys.argv) > 3 else "fp16"
wanted = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "all" else list(BLOCKS)
config_count = int(sys.argv[5]) if len(sys.argv) > 5 else None
dtype = DTYPES[dtype_name]
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cudnn.benchmark = True
rows = ProbeRows(out_path, batch, dtype, dtype_name, device)
best = {}


def timed(fn):
    """GPU time with the L2 flushed and launches hidden; on the CPU one call's wall time (smoke runs)."""
    if device.type == "cuda":
        return benchmark(fn, device, hide_launch=True)
    return benchmark(fn, device, warmup_ms=0.0, rep_ms=0.0, min_rep=1, max_rep=1)


for block in wanted:
    spec, y, bias, weight, _ = rows.layer(f"{block}.conv3")
    short_spec, x, short_bias, short_weight, _ = rows.layer(f"{block}.downsample.0")
    stride = short_spec.stride
    ref = F.conv2d(y.double(), weight.double(), bias.double()) + F.conv2d(
        x.double(), short_weight.double(), short_bias.double(), stride)
    ref = ref.clamp(min=0)
    extra = {"block": block, "shortcut_layer": short_spec.name, "shortcut_C": short_spec.C,
             "shortcut_H": short_spec.H, "shortcut_stride": stride[0]}
    w_cl, sw_cl = (w.contiguous(memory_format=torch.channels_last) for w in (weight, short_weight))

    def cudnn():
        return torch.relu_(F.conv2d(y, w_cl, bias).add_(F.conv2d(x, sw_cl, short_bias, stride)))

    times = {"cudnn": rows.emit(spec, "cudnn", {"epilogue": "add+relu"}, timed(cudnn),
                                relative_error(cudnn(), ref), extra)["median_ms"]}
    for config in auto_configs(spec, dtype)[:config_count]:
        separate_conv3 = pack_units(weight, *config.packing)
        separate_short = pack_units(short_weight, *config.packing)
        fused = pack_shortcut_units(weight, short_weight, config.group, config.chunk)
        fused_bias = (bias.float() + short_bias.float()).to(dtype)  # as BatchNorm folding would sum them

        def separate():
            residual = unit_conv(x, separate_short, stride, (0, 0), config, bias=short_bias)
            return unit_conv(y, separate_conv3, (1, 1), (0, 0), config, bias=bias, residual=residual, relu=True)

        def shortcut():
            return unit_conv(y, fused, (1, 1), (0, 0), config, bias=fused_bias, relu=True, shortcut=x,
                             shortcut_stride=stride)

        saved = dataclasses.asdict(config)
        for label, fn, packed in (("tensorcore-separate", separate, separate_conv3),
                                  ("tensorcore-shortcut", shortcut, fused)):
            row = rows.emit(spec, label, saved, timed(fn), relative_error(fn(), ref),
                            {**extra, **unit_counts(packed)})
            key = (block, label)
            best[key] = min(best.get(key, math.inf), row["median_ms"])
    best[(block, "cudnn")] = times["cudnn"]

saved_ms = 0.0
for block in wanted:
    cudnn_ms, separate_ms, shortcut_ms = (best[(block, label)] for label in
                                          ("cudnn", "tensorcore-separate", "tensorcore-shortcut"))
    saved_ms += separate_ms - shortcut_ms
    print(f"{block}: cuDNN {cudnn_ms * 1e3:.1f} us, two kernels {separate_ms * 1e3:.1f} us, one kernel "
          f"{shortcut_ms * 1e3:.1f} us: {separate_ms / shortcut_ms:.2f}x over two, {cudnn_ms / shortcut_ms:.2f}x "
          f"over cuDNN", flush=True)
print(f"one kernel per block saves {saved_ms * 1e3:.1f} us over these blocks (each timed alone, L2 flushed; "
      "the fastest packing of each variant)", flush=True)
