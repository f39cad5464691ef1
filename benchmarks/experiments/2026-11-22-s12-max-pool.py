"""Experiment (session 12): our max pool (kernels/triton/pool.py, no indices, layout kept) against
F.max_pool2d, on every max pool of googlenet, vgg16, resnet50 and alexnet-cifar at N=32.

A profile of the sparsified GoogLeNet (fp32, N=32, H100) found 0.75 ms per forward in PyTorch's
`max_pool_forward_nchw`, a quarter of the model's time. Per pool (input shape and arguments taken
from the model by forward hooks) and dtype (fp32 NCHW, fp16 channels_last): F.max_pool2d, and ours
with each config of `pool.CONFIGS` on the same NCHW / channels_last input and on a batch-innermost
one (F.max_pool2d copies that to NCHW first, so it is also timed there). GPU time with the launch
hidden, L2 flushed, medians; each output compared bitwise with F.max_pool2d's. One JSON line per
pool x dtype x layout x implementation; then each model's totals (ours: the default config).
Usage: python benchmarks/experiments/2026-11-22-s12-max-pool.py --out FILE [--batch 32]
"""
from __future__ import annotations

import argparse
import json
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.autotune.timing import benchmark
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.kernels.pool import PoolArgs
from sparsecnn.kernels.triton.pool import CONFIGS, DEFAULT, max_pool2d
from sparsecnn.models import build_model, default_input_shape

MODELS = ("googlenet", "vgg16", "resnet50", "alexnet-cifar")


def model_pools(name: str) -> List[Tuple[str, Tuple[int, int, int], PoolArgs]]:
    """(pool name, (C, H, W) of its input, its arguments) for each max pool the model calls."""
    model, found, current = build_model(name).eval(), [], ["F.max_pool2d"]
    original = F.max_pool2d
    hooks = [hook for path, module in model.named_modules() if isinstance(module, nn.MaxPool2d)
             for hook in (module.register_forward_pre_hook(lambda mod, args, path=path: current.append(path)),
                          module.register_forward_hook(lambda mod, args, out: current.pop() and None))]

    def functional(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        found.append((current[-1], tuple(x.shape[1:]), PoolArgs.of(kernel_size, stride, padding, dilation, ceil_mode)))
        return original(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode, return_indices=return_indices)

    F.max_pool2d = functional
    try:
        with torch.no_grad():
            model(torch.zeros(1, *default_input_shape(name)))
    finally:
        F.max_pool2d = original
        for hook in hooks:
            hook.remove()
    return found


def layouts(x: torch.Tensor, dtype: torch.dtype):
    native = x.contiguous(memory_format=torch.channels_last) if dtype == torch.float16 else x.contiguous()
    return {"nchw" if dtype == torch.float32 else "channels_last": native,
            "batch_inner": x.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)}


def pool_rows(base: dict, chw, args: PoolArgs, batch: int, dtype: torch.dtype) -> List[dict]:
    x = torch.randn(batch, *chw, device="cuda").to(dtype)
    want = F.max_pool2d(x, args.kernel_size, args.stride, args.padding, args.dilation, args.ceil_mode)
    rows = []
    for layout, xl in layouts(x, dtype).items():
        runs = {"torch": lambda xl=xl: F.max_pool2d(xl, args.kernel_size, args.stride, args.padding, args.dilation,
                                                   args.ceil_mode)}
        runs.update({f"ours-{c.block}x{c.num_warps}": (lambda xl=xl, c=c: max_pool2d(xl, args, c)) for c in CONFIGS})
        for impl, fn in runs.items():
            equal = bool(torch.equal(fn(), want))
            times = benchmark(fn, "cuda", hide_launch=True)
            rows.append({**base, "C": chw[0], "H": chw[1], "W": chw[2], "N": batch, "args": str(args),
                         "dtype": "fp32" if dtype == torch.float32 else "fp16", "layout": layout, "impl": impl,
                         "equal": equal, **times})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    env = {"run": new_run_id(), "kind": "experiment", "experiment": "s12-max-pool", **environment("cuda")}
    totals = {}
    with open(args.out, "a") as out:
        for model in MODELS:
            for pool, chw, pool_args in model_pools(model):
                for dtype in (torch.float32, torch.float16):
                    for row in pool_rows({**env, "model": model, "layer": pool}, chw, pool_args, args.batch, dtype):
                        out.write(json.dumps(row) + "\n")
                        default = row["impl"] in ("torch", f"ours-{DEFAULT.block}x{DEFAULT.num_warps}")
                        if default:
                            key = (model, row["dtype"], row["layout"], row["impl"].split("-")[0])
                            totals[key] = totals.get(key, 0.0) + row["median_ms"]
                        if not row["equal"]:
                            print("NOT EQUAL", row)
    for (model, dtype, layout, impl), ms in sorted(totals.items()):
        print(f"{model:14s} {dtype} {layout:13s} {impl:6s} {ms:.4f} ms")


if __name__ == "__main__":
    main()
