"""Where the time of tuning a model goes: `prepare_for_inference` + `sparsify_` from an empty
decision cache, under cProfile, on one CUDA GPU.

Runs the tuning --runs times, each from a fresh decision cache (so every candidate is timed again);
Triton's on-disk kernel cache (TRITON_CACHE_DIR) is kept between runs, so the first run pays the
kernel compiles and the later ones show the time without them. Prints, per run, the wall time and
the functions with the most cumulative time; with --triton-census instead of cProfile, the Triton
compiles per kernel (count, wall seconds) and the tuning's phase seconds.

    PYTHONPATH=src python scripts/profile_tuning.py resnet50 --pattern dlmc-magnitude_pruning --batch 32
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import copy
import io
import pstats
import tempfile
import threading
import time

import torch

from sparsecnn.bench.layers import precision
from sparsecnn.bench.models import _input, _pruned_model, _round_model_
from sparsecnn.passes.fuse import prepare_for_inference
from sparsecnn.tuning.sparsify import sparsify_


@contextlib.contextmanager
def _triton_census():
    """Record every Triton compile (kernel name -> wall seconds of each) while the block runs."""
    from triton.runtime.jit import JITFunction

    compiles, lock, original = collections.defaultdict(list), threading.Lock(), JITFunction._do_compile

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            with lock:
                compiles[self.__name__].append(time.perf_counter() - start)

    JITFunction._do_compile = timed
    try:
        yield compiles
    finally:
        JITFunction._do_compile = original


def _print_census(compiles, report) -> None:
    print("Triton compiles: kernel, count, total s, max s")
    for name, seconds in sorted(compiles.items(), key=lambda item: -sum(item[1])):
        print(f"  {name:32s} {len(seconds):4d} {sum(seconds):8.1f} {max(seconds):6.2f}")
    print("phases: " + ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in report.phase_s.items()))


def _tune_once(model: torch.nn.Module, x: torch.Tensor, dtype: str, top: int, census: bool) -> float:
    sparse = prepare_for_inference(copy.deepcopy(model))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir, precision(dtype), \
            (_triton_census() if census else contextlib.nullcontext()) as compiles:
        if not census:
            profiler.enable()
        sparsify_(sparse, x, backend="auto", dtype=dtype, cache_dir=cache_dir, progress=False)
        torch.cuda.synchronize()
        profiler.disable()
    seconds = time.perf_counter() - start
    if census:
        _print_census(compiles, sparse.sparsecnn_report)
        return seconds
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    print(text.getvalue())
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--pattern", default="random")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--top", type=int, default=45, help="functions printed per run")
    parser.add_argument("--triton-census", action="store_true", help="count Triton compiles instead of cProfile")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, _, _ = _pruned_model(args.model, args.sparsity, args.pattern, 0, None)
    model = _round_model_(model, args.dtype).to(device)
    x = _input(args.model, args.batch, 0, device, args.dtype)
    for run in range(args.runs):
        seconds = _tune_once(model, x, args.dtype, args.top, args.triton_census)
        print(f"tuning run {run}: {seconds:.1f} s ({args.model} N={args.batch} {args.dtype} {args.pattern})",
              flush=True)


if __name__ == "__main__":
    main()
