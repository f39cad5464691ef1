"""Experiment (session 13): the staged-input sparse conv (`kernels/codegen/staged.py`) against the
Triton "batch" kernel and cuDNN, layer by layer, fp32, N=32, batch-innermost input and output.

The "batch" kernel is L2-bound (one gather per multiply-add, 40% L1 hits); the staged kernel
stages each tile's input in shared memory once per block of 32-128 output channels. Per layer:
cuDNN fp32 (NCHW, TF32 off), the best of direct's "batch" auto configs, and every staged candidate
config, GPU time with the launch hidden, L2 flushed, medians; relative error against the fp64
reference into poisoned outputs; a residual and a ReLU fused into both sparse kernels when
--residual. One JSON line per (layer, backend, config).
Usage: python benchmarks/experiments/2026-11-23-s13-staged.py --out FILE [--suites resnet50,pietron-vgg16]
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from sparsecnn.autotune import benchmark
from sparsecnn.backends import get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.bench.schema import write_jsonl
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.codegen import staged
from sparsecnn.kernels.reference import reference_conv, relative_error
from sparsecnn.kernels.triton import direct_conv
from sparsecnn.layers import get_suite

LAYERS = {
    "resnet50": ("layer1.0.conv2,layer1.0.conv3,layer2.0.conv2,layer2.1.conv1,layer2.1.conv2,layer2.1.conv3,"
                 "layer2.0.downsample.0,layer3.0.conv2,layer3.1.conv1,layer3.1.conv2,layer3.1.conv3,layer4.1.conv1,"
                 "layer4.1.conv2,layer4.1.conv3"),
    "pietron-vgg16": "vgg-64x112-128,vgg-128x112-128,vgg-256x56-256,vgg-512x28-512,vgg-512x14-512",
}
TIMING = dict(warmup_ms=25, rep_ms=100, hide_launch=True)


def _time(fn, ref, out_numel):
    torch.empty(out_numel * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)
    err = relative_error(fn(), ref)
    return {**benchmark(fn, torch.device("cuda"), **TIMING), "rel_err": err}


def layer_rows(spec, pattern, residual, base):
    weight, label = make_weight(spec, 0.9, pattern, 0, "cuda")
    x = torch.randn(spec.input_shape, device="cuda")
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
    res = torch.randn(spec.output_shape, device="cuda") if residual else None
    if residual:
        ref = (ref.double() + res.double()).relu()
    x_inner = batch_inner_view(x.shape, x.dtype, x.device).copy_(x)
    res_inner = None if res is None else batch_inner_view(res.shape, x.dtype, x.device).copy_(res)
    out_inner = batch_inner_view(spec.output_shape, x.dtype, x.device)
    rows = []

    def row(backend, config, stats):
        rows.append({**base, **spec.as_dict(), "layer": spec.name, "dtype": "fp32", "pattern": label,
                     "sparsity": 0.9, "backend": backend, "config": {**config, "residual": residual}, **stats,
                     "floor_ms": None})

    def cudnn():
        y = F.conv2d(x, weight, None, spec.stride, spec.padding)
        return y.add_(res).relu_() if residual else y

    row("cudnn", {"layout": "nchw"}, _time(cudnn, ref, out_inner.numel()))
    backend = get_backend("direct")
    for config in backend.auto_configs(spec, torch.float32):
        if config.variant != "batch":
            continue
        packed = backend.prepare(weight, config)
        row("direct", {**dataclasses.asdict(config), "io": "batch_inner"},
            _time(lambda: direct_conv.direct_conv2d(x_inner, packed, None, spec.stride, spec.padding, config,
                                                    out=out_inner, residual=res_inner, relu=residual),
                  ref, out_inner.numel()))
    for config in staged.candidate_configs(spec):
        packed = staged.pack_weight(weight, config)
        row("staged", {**dataclasses.asdict(config), "io": "batch_inner"},
            _time(lambda: staged.staged_conv2d(x_inner, packed, spec.stride, spec.padding, config,
                                               residual=res_inner, relu=residual, out=out_inner),
                  ref, out_inner.numel()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--suites", default="resnet50,pietron-vgg16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--residual", action="store_true")
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    base = {"run": new_run_id(), "kind": "layer", **environment("cuda"), "model": None, "mode": "gpu"}
    for suite in args.suites.split(","):
        specs = {spec.name: spec.with_batch(args.batch) for spec in get_suite(suite)}
        pattern = "dlmc-magnitude_pruning" if suite == "resnet50" else "random"
        for name in LAYERS[suite].split(","):
            rows = layer_rows(specs[name], pattern, args.residual, {**base, "suite": suite})
            write_jsonl(rows, args.out)
            cudnn = rows[0]["median_ms"]
            best = {}
            for r in rows[1:]:
                if r["backend"] not in best or r["median_ms"] < best[r["backend"]]["median_ms"]:
                    best[r["backend"]] = r
            worst_err = max(r["rel_err"] for r in rows)
            summary = "  ".join(f"{b} {cudnn / r['median_ms']:.2f}x ({r['median_ms']:.4f} ms)" for b, r in best.items())
            print(f"{suite} {name}: cudnn {cudnn:.4f} ms  {summary}  max rel_err {worst_err:.2e}  "
                  f"staged best {best['staged']['config']}", flush=True)


if __name__ == "__main__":
    main()
