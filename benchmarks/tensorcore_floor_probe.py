"""Probe (issue 45): how fast could any one-kernel sparse layer be on ResNet-50's DLMC layers?

Per layer, in one run, L2 flushed, GPU time (launches hidden), the harness of the per-layer table:
- "cudnn": cuDNN NHWC without bias in the dtype (the per-layer table's baseline);
- "tensorcore": the tuner's configs for the layer (`auto_configs`, then `least_work_configs`), each
  timed, the fastest kept (channel-run tiles of 64 x units of 32, 0.9);
- "launch-only": a kernel of the tensorcore grid whose programs do nothing;
- "floor": `floor_kernels.floor_layer`, the grid reading the input once and writing the output
  once, no MMA; "floor-indexed": the same after one dependent load per program (a unit row).
The last lines give, per layer and as geomeans, cuDNN over each floor and our time over the indexed
floor. The traffic kernels turned out slower than ours (RESULTS.md, "A floor probe that is not a
floor"): read those ratios as a comparison, not a bound; launch-only is the one lower bound here.

Usage: python benchmarks/tensorcore_floor_probe.py OUT.jsonl BATCH [DTYPE] [LAYER,...|all]
On the CPU (TRITON_INTERPRET=1) it runs as a smoke test: one call's wall time, meaningless as a speed.
"""
import dataclasses
import math
import sys

import torch
import torch.nn.functional as F
from floor_kernels import floor_layer, floor_reference, launch_only
from tensorcore_probe_rows import ProbeRows, unit_counts

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import auto_configs, least_work_configs, unit_conv
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS
from sparsecnn.tuning.timing import benchmark

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

out_path, batch = sys.argv[1], int(sys.argv[2])
dtype_name = sys.argv[3] if len(sys.argv) > 3 else "fp16"
wanted = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "all" else list(DLMC_STUDY_LAYERS)
dtype = DTYPES[dtype_name]
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cudnn.benchmark = True
rows = ProbeRows(out_path, batch, dtype, dtype_name, device)
sink = torch.empty(1, device=device)


def timed(fn):
    """GPU time with the L2 flushed and launches hidden; on the CPU one call's wall time (smoke runs)."""
    if device.type == "cuda":
        return benchmark(fn, device, hide_launch=True)
    return benchmark(fn, device, warmup_ms=0.0, rep_ms=0.0, min_rep=1, max_rep=1)


best = {}
for name in wanted:
    spec, x, bias, weight, _ = rows.layer(name)
    ref = F.conv2d(x.double(), weight.double(), None, spec.stride, spec.padding)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    dense = lambda: F.conv2d(x, w_cl, None, spec.stride, spec.padding)
    times = {"cudnn": rows.emit(spec, "cudnn", {"bias": False}, timed(dense), relative_error(dense(), ref))}
    ours = math.inf
    for config in least_work_configs(weight, auto_configs(spec, dtype)):
        packed = pack_units(weight, *config.packing)
        fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config)
        row = rows.emit(spec, "tensorcore", dataclasses.asdict(config), timed(fn), relative_error(fn(), ref),
                        unit_counts(packed))
        ours = min(ours, row["median_ms"])
    times["launch-only"] = rows.emit(spec, "launch-only", None, timed(lambda: launch_only(spec, sink)), math.nan)
    floor_ref = floor_reference(x, spec)
    for label, indexed in (("floor", False), ("floor-indexed", True)):
        fn = lambda: floor_layer(x, spec, indexed)
        times[label] = rows.emit(spec, label, {"indexed": indexed}, timed(fn), relative_error(fn(), floor_ref))
    best[name] = {label: row["median_ms"] for label, row in times.items()} | {"tensorcore": ours}


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


for name, ms in best.items():
    print(f"{name:22s} cuDNN {ms['cudnn'] * 1e3:6.1f} us, ours {ms['tensorcore'] * 1e3:6.1f}, launch-only "
          f"{ms['launch-only'] * 1e3:5.1f}, floor {ms['floor'] * 1e3:5.1f}, indexed {ms['floor-indexed'] * 1e3:5.1f}: "
          f"cuDNN/floor-indexed {ms['cudnn'] / ms['floor-indexed']:.2f}x, ours/floor-indexed "
          f"{ms['tensorcore'] / ms['floor-indexed']:.2f}x", flush=True)
ratios = {key: geomean([ms["cudnn"] / ms[key] for ms in best.values()]) for key in ("tensorcore", "floor",
                                                                                      "floor-indexed")}
print(f"geomean over cuDNN: ours {ratios['tensorcore']:.2f}x; the most a kernel at the floor could reach "
      f"{ratios['floor']:.2f}x, at the indexed floor {ratios['floor-indexed']:.2f}x; ours over the indexed floor "
      f"{geomean([ms['tensorcore'] / ms['floor-indexed'] for ms in best.values()]):.2f}x", flush=True)
