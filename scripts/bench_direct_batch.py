"""direct's batch-innermost variant against its NCHW "chunk" variant and cuDNN, layer by layer.

For each layer (DLMC ResNet-50 masks by default): cuDNN (fp32 NCHW with TF32 off, or fp16
channels_last), every "chunk" candidate config, every "batch" config with NCHW input and output
(the layout copy inside the timed call) and with batch-innermost input and output (as between two
batch layers), and the layout copy alone. Rows: the results schema, kind "layer"; the config dict
says the variant and `io` ("nchw" or "batch_inner"); the copy alone is backend "layout-copy".
--residual adds a residual of the output's layout and a ReLU to every call (fused into direct; an
add and a ReLU after cuDNN), as in a bottleneck's last conv; the config dict then says "residual".
Usage: python scripts/bench_direct_batch.py --out FILE [--layers a,b] [--dtypes fp32,fp16] [--batch 32]
    [--variants chunk,batch] [--residual]
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
from sparsecnn.bench.schema import torch_dtype, write_jsonl
from sparsecnn.kernels.batch_inner import batch_inner_view
from sparsecnn.kernels.reference import reference_conv, relative_error
from sparsecnn.kernels.triton import direct_batch, direct_conv
from sparsecnn.layers import get_suite

DEFAULT_LAYERS = ("layer1.0.conv2,layer1.0.conv3,layer2.0.conv2,layer2.1.conv2,layer2.0.downsample.0,"
                  "layer3.0.conv1,layer3.1.conv2,layer3.0.conv2,layer4.1.conv1,layer4.1.conv2,layer4.0.conv2")
TIMING = dict(warmup_ms=25, rep_ms=100, hide_launch=True)  # GPU time, as under CUDA graphs (mode "gpu")


def _time(fn, ref):
    """Timing stats and the relative error of one run into poisoned memory (None when `ref` is None)."""
    err = None
    if ref is not None:
        torch.empty(ref.numel() * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)
        err = relative_error(fn(), ref)
    return {**benchmark(fn, torch.device("cuda"), **TIMING), "rel_err": err}


def _layer_rows(spec, dtype_name, args, base):
    dtype = torch_dtype(dtype_name)
    weight, label = make_weight(spec, args.sparsity, args.pattern, 0, "cuda")
    weight = weight.to(dtype)
    x = torch.randn(spec.input_shape, device="cuda").to(dtype)
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
    res = res_inner = None
    if args.residual:
        res = torch.randn(spec.output_shape, device="cuda").to(dtype)
        res_inner = batch_inner_view(spec.output_shape, dtype, x.device).copy_(res)
        ref = (ref.double() + res.double()).relu()
    fused = dict(relu=True) if args.residual else {}
    stride, padding = spec.stride, spec.padding
    rows = []

    def row(backend, config, stats):
        config = {**config, "residual": True} if args.residual and backend != "layout-copy" else config
        rows.append({**base, **spec.as_dict(), "layer": spec.name, "dtype": dtype_name, "pattern": label,
                     "backend": backend, "config": config, **stats, "floor_ms": None})

    def cudnn():
        y = F.conv2d(xc, wc, None, stride, padding)
        return y.add_(res).relu_() if args.residual else y

    layout = torch.channels_last if dtype != torch.float32 else torch.contiguous_format
    xc, wc = x.to(memory_format=layout), weight.to(memory_format=layout)
    row("cudnn", {"layout": "channels_last" if dtype != torch.float32 else "nchw"},
        _time(cudnn, ref))
    backend = get_backend("direct")
    x_inner = batch_inner_view(x.shape, dtype, x.device).copy_(x)
    for config in backend.configs(spec, dtype):
        if config.variant not in args.variants.split(","):
            continue
        packed = backend.prepare(weight, config)
        cfg = dataclasses.asdict(config)
        row("direct", {**cfg, "io": "nchw"},
            _time(lambda: direct_conv.direct_conv2d(x, packed, None, stride, padding, config, residual=res, **fused),
                  ref))
        if config.variant == "batch":
            out = batch_inner_view(spec.output_shape, dtype, x.device)
            row("direct", {**cfg, "io": "batch_inner"},
                _time(lambda: direct_conv.direct_conv2d(x_inner, packed, None, stride, padding, config, out=out,
                                                        residual=res_inner, **fused), ref))
    row("layout-copy", {"from": "nchw", "to": "padded batch_inner"},
        _time(lambda: direct_batch.padded_batch_inner(x, *padding), None))
    row("layout-copy", {"from": "batch_inner", "to": "padded batch_inner"},
        _time(lambda: direct_batch.padded_batch_inner(x_inner, *padding), None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", default=DEFAULT_LAYERS)
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--variants", default="chunk,batch", help="direct variants to time: chunk, batch")
    parser.add_argument("--residual", action="store_true", help="fuse a residual add and a ReLU")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--pattern", default="dlmc-magnitude_pruning")
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    specs = {spec.name: spec.with_batch(args.batch) for spec in get_suite("resnet50")}
    base = {"run": new_run_id(), "kind": "layer", **environment("cuda"), "suite": "resnet50", "model": None,
            "sparsity": args.sparsity, "mode": "gpu"}
    for dtype_name in args.dtypes.split(","):
        for name in args.layers.split(","):
            rows = _layer_rows(specs[name], dtype_name, args, base)
            write_jsonl(rows, args.out)
            cudnn = rows[0]["median_ms"]
            best = {}
            for r in rows[1:]:
                key = (r["backend"], r["config"].get("variant"), r["config"].get("io"), r["config"].get("from"))
                if key not in best or r["median_ms"] < best[key][0]:
                    best[key] = (r["median_ms"], r["rel_err"])
            summary = "  ".join(f"{'/'.join(str(k) for k in key if k)} {cudnn / ms:.2f}x" for key, (ms, _) in best.items())
            print(f"{dtype_name} {name}: cudnn {cudnn:.4f} ms  {summary}", flush=True)


if __name__ == "__main__":
    main()
