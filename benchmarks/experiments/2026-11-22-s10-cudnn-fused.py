"""Experiment (session 10): cuDNN's fused conv + bias (+ residual) + ReLU against the unfused chain.

A dense layer of a folded model runs F.conv2d(x, w, b) (cuDNN conv, then a bias-add kernel), then
add_(residual) and relu_(): up to four kernels, each re-reading the output. aten's
cudnn_convolution_relu / cudnn_convolution_add_relu run the chain as one cuDNN fusion graph. This
times both on every conv of ResNet-50 at N=32 (random weights: dense cuDNN's time does not depend
on the values), fp16 NHWC and fp32 NCHW with TF32 off, GPU time (launch hidden), L2 flushed.
Writes one JSON line per layer x dtype x variant.
Usage: python benchmarks/experiments/2026-11-22-s10-cudnn-fused.py --out FILE
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sparsecnn.autotune.timing import benchmark
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.layers import get_suite


def _unfused(x, w, b, z, spec):
    y = F.conv2d(x, w, b, spec.stride, spec.padding)
    if z is not None:
        y.add_(z)
    return y.relu_()


def _fused(x, w, b, z, spec):
    stride, padding = list(spec.stride), list(spec.padding)
    if z is None:
        return torch.cudnn_convolution_relu(x, w, b, stride, padding, [1, 1], 1)
    return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, stride, padding, [1, 1], 1)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    run, env = new_run_id(), environment(device)
    totals = {}
    with open(args.out, "a") as out, torch.no_grad():
        for dtype_name, dtype, fmt in (("fp16", torch.float16, torch.channels_last),
                                       ("fp32", torch.float32, torch.contiguous_format)):
            for spec in get_suite("resnet50", args.batch):
                gen = torch.Generator(device="cpu").manual_seed(0)
                x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(device, dtype)
                w = (torch.randn(spec.K, spec.C, spec.R, spec.S, generator=gen) * (spec.C * spec.R * spec.S) ** -0.5)
                b = torch.randn(spec.K, generator=gen).to(device, dtype)
                x, w = x.contiguous(memory_format=fmt), w.to(device, dtype).contiguous(memory_format=fmt)
                out_shape = (spec.N, spec.K, spec.P, spec.Q)
                for with_residual in (False, True):
                    z = torch.randn(out_shape, generator=gen).to(device, dtype).contiguous(memory_format=fmt) \
                        if with_residual else None
                    ref = _unfused(x.double(), w.double(), b.double(), None if z is None else z.double(), spec)
                    for variant, fn in (("unfused", _unfused), ("fused", _fused)):
                        try:
                            y = fn(x, w, b, z, spec)
                            err = _rel_err(y, ref)
                            ms = benchmark(lambda: fn(x, w, b, z, spec), device, hide_launch=True)["median_ms"]
                        except RuntimeError as error:
                            print(f"{spec.name} {dtype_name} {variant}: {error}"[:300])
                            continue
                        key = (dtype_name, with_residual, variant)
                        totals[key] = totals.get(key, 0.0) + ms
                        row = {"run": run, "kind": "layer", **env, "suite": "resnet50", "layer": spec.name,
                               **{k: getattr(spec, k) for k in ("N", "C", "K", "H", "W", "R", "S")},
                               "stride": list(spec.stride), "padding": list(spec.padding), "dtype": dtype_name,
                               "sparsity": 0.0, "pattern": "random", "backend": f"cudnn-{variant}",
                               "config": {"residual": with_residual, "layout": str(fmt)}, "mode": "gpu",
                               "median_ms": ms, "rel_err": err}
                        out.write(json.dumps(row) + "\n")
                        print(f"{spec.name:26s} {dtype_name} residual={with_residual!s:5s} {variant:8s} "
                              f"{ms:.4f} ms err {err:.2e}")
    for key, ms in sorted(totals.items()):
        print("total", key, f"{ms:.3f} ms")


if __name__ == "__main__":
    main()
