"""Every candidate config of the `unrolled` backend on chosen layers, against cuDNN (fp32, TF32, fp16)
in the same run: the measurements behind `unrolled.auto_config`.

Usage (GPU machine; no `__main__` guard on purpose):
    python benchmarks/unrolled_sweep.py OUT.jsonl SUITE PATTERN BATCH DTYPE LAYER ...
e.g. `... out.jsonl resnet50 dlmc-magnitude_pruning 32 fp16 layer2.1.conv2 layer3.1.conv1`; DTYPE: fp32
(the exact kernel) or fp16 (packed pairs of images). The kernels of
every (layer, config) compile first, at once (ptxas processes in threads, into the codegen disk
cache), then `bench_layers(configs="all")` times them: rows as `sparsecnn bench layers` writes.
"""
import concurrent.futures
import os
import sys
import time

import torch

from sparsecnn.backends.unrolled import kernel as unrolled
from sparsecnn.bench import bench_layers, markdown_table, write_jsonl
from sparsecnn.bench.patterns import make_weight
from sparsecnn.layers.suites import get_suite

OUT, SUITE, PATTERN, DTYPE = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5]
BATCH, LAYERS = int(sys.argv[4]), sys.argv[6:]
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16}[DTYPE]
SPARSITY, SEED = 0.9, 0
specs = [spec for spec in get_suite(SUITE, batch=BATCH) if spec.name in LAYERS]
start = time.perf_counter()
jobs = []
for spec in specs:
    weight, _ = make_weight(spec, SPARSITY, PATTERN, SEED, "cuda")
    # rounded as the fp16 module's weight will be, so that the timed kernels come from this compile's cache
    weight = weight.cpu().to(TORCH_DTYPE).float()
    jobs += [(weight, spec, config) for config in unrolled.candidate_configs(spec, int(weight.count_nonzero()), TORCH_DTYPE)]
with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
    list(pool.map(lambda job: unrolled.compile_layer(*job, dtype=TORCH_DTYPE), jobs))
print(f"{len(jobs)} kernels compiled in {time.perf_counter() - start:.0f} s", flush=True)
rows = bench_layers(specs, suite=SUITE, sparsity=SPARSITY, pattern=PATTERN, dtype=DTYPE, backends=["unrolled"],
                    device=torch.device("cuda"), seed=SEED, configs="all", progress=False,
                    timing={"warmup_ms": 10, "rep_ms": 40}, on_rows=lambda layer_rows: write_jsonl(layer_rows, OUT))
print(markdown_table(rows))
for row in rows:
    if row["backend"] == "unrolled":
        config = row["config"]
        print(f"{row['layer']:24} bk={config['bk']:3} threads={config['threads']:4} slices={config['slices']} tq={config['tq']} "
              f"{row['median_ms']:.4f} ms  rel_err {row['rel_err']:.1e}")
