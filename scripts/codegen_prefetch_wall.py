"""Wall time of backend `codegen`'s compiles in worker processes, as cold tuning waits for them, offline
(no GPU): densenet121's convs that `backend="auto"` compiles, each with a random weight pruned to 0.9
(seed 0), fp32, sm_90, an empty disk cache; every layer's compile submitted (`prefetch`), then taken in
model order, as the tuner binds them.

Usage (CPU; set SPARSECNN_COMPILE_WORKERS for the worker count):
    python scripts/codegen_prefetch_wall.py OUT.jsonl MODE
MODE: rewrite or emit, the mode of the default config compiled (what `backend="auto"` compiles is
`get_backend("codegen").auto_configs`). One JSON line: layers, workers, mode, wall seconds, and the
worker pool's job times (`core.workers.JobTimes`).
densenet121's conv shapes are listed here (torchvision need not import): growth 32, bottleneck 128,
blocks of 6, 12, 24 and 16 layers at 56, 28, 14 and 7 pixels, transitions halving the channels.
"""
import dataclasses
import json
import os
import sys
import tempfile
import time

if len(sys.argv) != 3 or sys.argv[2] not in ("rewrite", "emit"):
    raise SystemExit(__doc__)
os.environ["SPARSECNN_CACHE"] = tempfile.mkdtemp()

import torch  # noqa: E402  (after the cache is set)

from sparsecnn.backends import get_backend  # noqa: E402
from sparsecnn.backends.codegen.backend import CodegenWeight  # noqa: E402
from sparsecnn.bench.env import environment  # noqa: E402
from sparsecnn.core import toolchain  # noqa: E402
from sparsecnn.core.spec import ConvSpec  # noqa: E402
from sparsecnn.core.workers import job_times  # noqa: E402


def densenet121_convs():
    """(name, C, K, R, HW) of densenet121's convs after the stem, in model order."""
    convs, size, channels = [], 56, 64
    for block, layers in enumerate((6, 12, 24, 16)):
        for index in range(layers):
            convs.append((f"denseblock{block + 1}.{index}.conv1", channels + 32 * index, 128, 1, size))
            convs.append((f"denseblock{block + 1}.{index}.conv2", 128, 32, 3, size))
        channels += 32 * layers
        if block < 3:
            convs.append((f"transition{block + 1}.conv", channels, channels // 2, 1, size))
            channels, size = channels // 2, size // 2
    return convs


CODEGEN = get_backend("codegen")
torch.manual_seed(0)
layers = []
for name, channels, kernels, taps, size in densenet121_convs():
    spec = ConvSpec(32, channels, kernels, size, size, taps, taps, padding=taps // 2, name=name)
    auto = CODEGEN.auto_configs(spec, torch.float32)
    if auto:
        weight = torch.randn(kernels, channels, taps, taps) * (torch.rand(kernels, channels, taps, taps) > 0.9)
        layers.append((spec, weight, dataclasses.replace(auto[0], mode=sys.argv[2])))
start = time.perf_counter()
for spec, weight, config in layers:
    CODEGEN.prefetch(spec, weight, torch.float32, False, [config])
for spec, weight, config in layers:
    CodegenWeight(weight).compiled(spec, config, False, torch.float32)
row = {**environment("cpu"), "toolchain": toolchain.toolchain_id("90"), "cpus": os.cpu_count(),
       "kind": "codegen prefetch wall", "dtype": "fp32", "sparsity": 0.9, "pattern": "random",
       "model": "densenet121", "layers": len(layers), "mode": sys.argv[2],
       "workers": os.environ.get("SPARSECNN_COMPILE_WORKERS"), "wall_s": round(time.perf_counter() - start, 2),
       "jobs": {pool: dataclasses.asdict(times) for pool, times in job_times().items()}}
with open(sys.argv[1], "a") as out:
    out.write(json.dumps(row) + "\n")
print(row)
