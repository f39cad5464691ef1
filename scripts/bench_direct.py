"""Benchmark backend `direct` (every candidate config) against cuDNN on a CUDA GPU.

For each layer of the given suites, dtype and sparsity: a random weight with exactly
round(sparsity * numel) zeros (top-k of random scores), a random input and bias; times cuDNN
fp32 (TF32 off, NCHW), cuDNN fp16 (channels_last) and `direct` with every candidate config, with
`sparsecnn.autotune.timing.benchmark` (CUDA events, L2 flushed). Prints one line per layer
and dtype (best config, its time, speedup over cuDNN fp32 and fp16, relative error against an
fp64 reference) and writes one JSON line per measurement to --out.

    PYTHONPATH=src python scripts/bench_direct.py --suites dong pietron-r50-1x1 --out direct.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

try:
    import sparsecnn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparsecnn.autotune.timing import benchmark
from sparsecnn.formats import OffsetCSRWeight, UniformELLWeight
from sparsecnn.kernels.reference import relative_error
from sparsecnn.kernels.triton import direct_conv
from sparsecnn.layers import ConvSpec, get_suite

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = {"ell": UniformELLWeight, "csr": OffsetCSRWeight}


def exact_sparse_weight(spec: ConvSpec, sparsity: float, gen: torch.Generator) -> torch.Tensor:
    """(K, C, R, S) float32 on CUDA with exactly round(sparsity * numel) zeros at random places."""
    weight = torch.randn(spec.weight_shape, device="cuda", generator=gen)
    keep = round((1.0 - sparsity) * weight.numel())
    mask = torch.zeros(weight.numel(), dtype=torch.bool, device="cuda")
    mask[torch.rand(weight.numel(), device="cuda", generator=gen).topk(keep).indices] = True
    return weight * mask.view_as(weight)


def time_ms(fn, args) -> float:
    return benchmark(fn, "cuda", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)["median_ms"]


def cudnn_fn(x32, w32, b32, spec: ConvSpec, dtype: torch.dtype):
    """cuDNN at `dtype`: NCHW for fp32 (TF32 off), channels_last for fp16/bf16 (their fastest)."""
    torch.backends.cudnn.allow_tf32 = False
    layout = torch.contiguous_format if dtype == torch.float32 else torch.channels_last
    x, w, b = x32.to(dtype, memory_format=layout), w32.to(dtype, memory_format=layout), b32.to(dtype)
    return lambda: F.conv2d(x, w, b, spec.stride, spec.padding)


def bench_direct_configs(x, weight, bias, spec: ConvSpec, ref, args) -> List[dict]:
    """One record per candidate config: median_ms and rel_err, or the error that stopped it."""
    records = []
    packed = {variant: fmt.from_dense(weight) for variant, fmt in FORMATS.items()}
    for config in direct_conv.candidate_configs(spec, x.dtype):
        if config.variant not in args.variants:
            continue
        fn = lambda: direct_conv.direct_conv2d(x, packed[config.variant], bias, spec.stride,  # noqa: E731
                                               spec.padding, config)
        record = {"config": dataclasses.asdict(config)}
        try:
            record["rel_err"] = relative_error(fn(), ref)
            record["median_ms"] = time_ms(fn, args)
        except Exception as exc:  # noqa: BLE001  (a config the GPU refuses is reported, not fatal)
            record.update(median_ms=None, error=f"{type(exc).__name__}: {exc}"[:300])
        records.append(record)
        if args.first_config_only:
            break
    ell = packed["ell"]
    for record in records:
        record.update(nnz=ell.nnz, ell_padding_overhead=round(ell.padding_overhead, 4))
    return records


def pad_ms(x, spec: ConvSpec, args) -> Optional[float]:
    """Time of the launcher's zero-padding copy alone (it is part of every `direct` time)."""
    if spec.padding == (0, 0):
        return None
    return time_ms(lambda: direct_conv._padded_nchw(x, *spec.padding), args)


def bench_layer(suite: str, spec: ConvSpec, sparsity: float, args, out) -> None:
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    w32 = exact_sparse_weight(spec, sparsity, gen)
    x32 = torch.randn(spec.input_shape, device="cuda", generator=gen)
    b32 = torch.randn(spec.K, device="cuda", generator=gen)
    cudnn_ms = {name: time_ms(cudnn_fn(x32, w32, b32, spec, DTYPES[name]), args)
                for name in dict.fromkeys(["fp32", "fp16", *args.dtypes])}
    base = dict(suite=suite, layer=spec.name, N=spec.N, sparsity=sparsity, C=spec.C, K=spec.K, H=spec.H,
                W=spec.W, R=spec.R, S=spec.S, stride=list(spec.stride), padding=list(spec.padding),
                cudnn_fp32_ms=cudnn_ms["fp32"], cudnn_fp16_ms=cudnn_ms["fp16"], gpu=torch.cuda.get_device_name())
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        x, weight, bias = x32.to(dtype), w32.to(dtype), b32.to(dtype)
        ref = F.conv2d(x.double(), weight.double(), bias.double(), spec.stride, spec.padding)
        row = dict(base, dtype=dtype_name, cudnn_ms=cudnn_ms[dtype_name])
        cudnn_err = relative_error(cudnn_fn(x32, w32, b32, spec, dtype)(), ref)
        out.write(json.dumps(dict(row, backend="cudnn", config=None, median_ms=cudnn_ms[dtype_name],
                                  rel_err=cudnn_err)) + "\n")
        records = bench_direct_configs(x, weight, bias, spec, ref, args)
        padding_ms = pad_ms(x, spec, args)
        for record in records:
            out.write(json.dumps(dict(row, backend="direct", pad_ms=padding_ms, **record)) + "\n")
        out.flush()
        print_summary(row, records, cudnn_err)
        del ref
        torch.cuda.empty_cache()


def print_summary(row: dict, records: List[dict], cudnn_err: float) -> None:
    ran = [r for r in records if r.get("median_ms") is not None]
    head = (f"{row['suite']:<18} {row['layer']:<18} N={row['N']:<4} {row['dtype']:<5} "
            f"s={row['sparsity']:<5} cudnn32={row['cudnn_fp32_ms']:.4f} cudnn16={row['cudnn_fp16_ms']:.4f}")
    if not ran:
        print(f"{head}  direct: no config ran ({records[0].get('error') if records else 'none'})")
        return
    best = min(ran, key=lambda r: r["median_ms"])
    c = best["config"]
    label = f"{c['variant']}/p{c['block_pix']}/k{c['block_k']}/sb{c['sub_batch']}/w{c['num_warps']}"
    print(f"{head}  direct={best['median_ms']:.4f} [{label}] x{row['cudnn_fp32_ms'] / best['median_ms']:.2f} "
          f"vs fp32, x{row['cudnn_fp16_ms'] / best['median_ms']:.2f} vs fp16, err={best['rel_err']:.1e} "
          f"(cudnn {cudnn_err:.1e}), "
          f"ell_pad={best['ell_padding_overhead']:.2f}, {len(ran)}/{len(records)} configs ran")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=["dong"], help="names for sparsecnn.layers.get_suite")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: each suite's own)")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.9])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "fp16"], choices=sorted(DTYPES))
    parser.add_argument("--variants", nargs="+", default=["ell", "csr"], choices=sorted(FORMATS))
    parser.add_argument("--layers", nargs="*", default=None, help="only layers whose name contains one of these")
    parser.add_argument("--first-config-only", action="store_true", help="only the default config")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines output path")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_direct.py needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for suite in args.suites:
            for spec in get_suite(suite, args.batch):
                if args.layers and not any(name in spec.name for name in args.layers):
                    continue
                for sparsity in args.sparsity:
                    bench_layer(suite, spec, sparsity, args, out)


if __name__ == "__main__":
    main()
