"""Where does `torch.compile(mode="max-autotune")` spend 20-100 s per conv shape on the device image?

Session 17 probe for the GoogLeNet dense max-autotune baseline (issue 6): GoogLeNet has ~55 conv
shapes, more than one device call at that rate. Compiles one single-conv module per GoogLeNet shape
given, each in a fresh inductor and Triton cache, with inductor's autotuning as configured by the
environment (run it once as is, once with TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1, ...), and prints
the wall seconds per shape; with --profile, the main thread's top functions by own time.

    python benchmarks/experiments/2026-11-23-s17-maxautotune-probe.py --start 4 --shapes 2 [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch

from sparsecnn.layers.suites import specs_from_model
from sparsecnn.models import build_model


def googlenet_shapes(batch: int):
    """Distinct conv shapes of GoogLeNet at `batch`, model order."""
    seen, shapes = set(), []
    for spec in specs_from_model(build_model("googlenet"), (batch, 3, 224, 224)):
        key = (spec.C, spec.K, spec.H, spec.W, spec.R, spec.S, spec.stride, spec.padding)
        if key not in seen:
            seen.add(key)
            shapes.append(spec)
    return shapes


def compile_one(spec) -> float:
    conv = torch.nn.Conv2d(spec.C, spec.K, (spec.R, spec.S), spec.stride, spec.padding, bias=False).cuda()
    x = torch.randn(spec.N, spec.C, spec.H, spec.W, device="cuda")
    torch._dynamo.reset()
    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(conv, mode="max-autotune")(x)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--start", type=int, default=0, help="index of the first shape")
    parser.add_argument("--shapes", type=int, default=2, help="how many shapes")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    shapes = googlenet_shapes(32)
    print(f"{len(shapes)} distinct conv shapes; env:",
          {k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_AUTOTUNE")}, flush=True)
    profiler = cProfile.Profile() if args.profile else None
    for spec in shapes[args.start:args.start + args.shapes]:
        if profiler:
            profiler.enable()
        seconds = compile_one(spec)
        if profiler:
            profiler.disable()
        print(f"{spec.name}: C={spec.C} K={spec.K} {spec.H}x{spec.W} {spec.R}x{spec.S} s{spec.stride[0]}: "
              f"{seconds:.1f} s", flush=True)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
