"""Where a sparsified model's eager calls spend CPU time (the launch cost CUDA graphs hide).

Tunes the model as `sparsecnn bench model` does, then times eager calls two ways: wall time per
call over back-to-back calls (`bench model --modes eager` times each call after an L2 flush, which
lets the CPU run ahead and hides part of its cost) and CPU time per call to issue
the work (perf_counter around calls that are not synchronised; the GPU queue is deep enough for
one call), alternately with Triton's own launches and `core/triton_launch.py`'s. Then cProfile
over the calls: the top functions by own time and by cumulative time.
Usage: python scripts/profile_eager.py resnet50 --pattern dlmc-magnitude_pruning [--calls 50]
"""
from __future__ import annotations

import cProfile
import os
import pstats
import time

import torch

from profile_model_kernels import model_parser, tuned_model  # this folder is on sys.path
from sparsecnn.tuning.timing import eager_wall_ms
from sparsecnn import settings


def _cpu_ms_per_call(model: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    issued = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(x)
        issued += time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * issued / calls


def main() -> None:
    parser = model_parser(__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    sparse, x, _, _, _ = tuned_model(args, torch.device("cuda"))
    with torch.no_grad():
        for _ in range(5):
            sparse(x)
        for enabled in (False, True, False, True):  # the same process: Triton's launches vs ours
            os.environ[settings.FAST_LAUNCH.name] = "1" if enabled else "0"  # read at every launch
            wall = eager_wall_ms(lambda: sparse(x), x.device, args.calls)
            issue = _cpu_ms_per_call(sparse, x, args.calls)
            print(f"fast launches {'on ' if enabled else 'off'}: eager wall {wall:.3f} ms/call, "
                  f"CPU issue {issue:.3f} ms/call", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            sparse(x)
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
