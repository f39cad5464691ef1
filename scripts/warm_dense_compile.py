"""Fill the inductor caches with a model's dense `torch.compile` baseline, before `bench model` times it.

On the device image `torch.compile(mode="max-autotune")` spends 20-90 s autotuning each conv shape
(`benchmarks/results/2026-11-22-h100-s8-maxautotune-r18c-partial.txt`), so a ResNet-50 outlasts one
device call. Run this under `TORCHINDUCTOR_CACHE_DIR=D` (stopped by `timeout` if need be: each
finished shape's choice is already on disk), keep D between calls, and the next call resumes; once
it completes, `bench model ... --modes compile` under the same D compiles from the cache. The model
is built as `bench model` builds its dense variant (same dtype, layout, batch and TF32 flags), so
the graphs and their cache keys match; pruning does not change the graph.

    python scripts/warm_dense_compile.py resnet50 --batch 32 --dtype fp32 [--mode max-autotune]
"""
from __future__ import annotations

import argparse
import time

import torch

from sparsecnn.bench.layers import precision
from sparsecnn.bench.schema import torch_dtype
from sparsecnn.models import build_model, default_input_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--mode", default="max-autotune")
    args = parser.parse_args()
    stored = torch_dtype(args.dtype)
    layout = torch.channels_last if stored in (torch.float16, torch.bfloat16) else torch.contiguous_format
    model = build_model(args.model).eval().to("cuda", dtype=stored, memory_format=layout)
    x = torch.randn(args.batch, *default_input_shape(args.model), device="cuda").to(stored, memory_format=layout)
    start = time.perf_counter()
    with precision(args.dtype), torch.no_grad():
        compiled = torch.compile(model, mode=args.mode)
        compiled(x)
        torch.cuda.synchronize()
    print(f"compiled {args.model} N={args.batch} {args.dtype} mode={args.mode} in {time.perf_counter() - start:.1f} s",
          flush=True)


if __name__ == "__main__":
    main()
