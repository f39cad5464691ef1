"""Benchmark backend `blocks` (OptPrune: dense-block GEMM + sparse remainder) against cuDNN on a GPU.

Suites: resnet50 with real DLMC masks (magnitude_pruning-0.9, N=32) and pietron-vgg16 with
random 90% masks (N=128); --batch overrides both, --quick keeps a few layers of each.
Per layer: Algorithm 1 for t2 in {4, 8, 12, 16} and the packing of every candidate config run in
worker processes (one BLAS thread each); then on the GPU, with `sparsecnn.autotune.timing.benchmark`
(CUDA events, L2 flushed): cuDNN fp16 (channels_last), fp32 (TF32 off) and TF32, and `blocks` with
every candidate config in three modes: fp16, fp32 exact ("ieee") and fp32 TF32. Prints one line
per layer and mode (blocks, share of non-zeros in blocks, fill, best config, ms, speedups, relative
error against fp64 on the first --ref-images images) and writes one JSON line per measurement to
--out.

    PYTHONPATH=src python scripts/bench_blocks.py --out blocks.jsonl [--quick] [--batch 16]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

try:
    import sparsecnn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparsecnn.autotune.timing import benchmark
from sparsecnn.formats import BlockParams, extract_blocks
from sparsecnn.kernels.reference import relative_error
from sparsecnn.layers import ConvSpec, get_suite

DLMC_SET = "magnitude_pruning-0.9"
MODES = {"fp16": (torch.float16, None), "fp32": (torch.float32, "ieee"), "tf32": (torch.float32, "tf32")}
SUITE_BATCH = {"resnet50": 32, "pietron-vgg16": 128}
QUICK_LAYERS = {"resnet50": ["conv1", "layer1.0.conv2", "layer2.0.conv1", "layer3.1.conv2",
                             "layer4.0.downsample.0", "layer4.2.conv2"],
                "pietron-vgg16": ["vgg-128x112-128", "vgg-512x14-512"]}
Packing = Tuple[int, int, int]  # (t2, block_m, block_kred)


# --- weights and packing (CPU, worker processes) ----------------------------------------------

def layer_weight(suite: str, spec: ConvSpec, sparsity: float, seed: int) -> torch.Tensor:
    """float32 (K, C, R, S) on CPU: N(0, 2 / fan_in) values on the layer's mask.

    resnet50: the DLMC mask of the layer; other suites: exactly round(sparsity * numel) zeros.
    """
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(spec.weight_shape, generator=gen) * math.sqrt(2.0 / (spec.C * spec.R * spec.S))
    if suite == "resnet50":
        from sparsecnn.prune import dlmc_layer_mask

        return values * dlmc_layer_mask(DLMC_SET, spec.name)
    keep = round((1.0 - sparsity) * values.numel())
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[torch.rand(values.numel(), generator=gen).topk(keep).indices] = True
    return values * mask.view_as(values)


def pack_layer(weight: torch.Tensor, t2: int, configs: list) -> bytes:
    """Worker: Algorithm 1 with this t2, then a CPU `BlocksWeight` per distinct packing.

    Returns pickle bytes of (report dict, {packing: BlocksWeight}): plain pickling copies the
    tensors, where the pool's own pickler would pass each through shared memory (one file
    descriptor per tensor, hundreds per layer).
    """
    from sparsecnn.kernels.triton.blocks_conv import BlocksWeight

    decomposition = extract_blocks(weight, BlockParams(t2=t2))
    packed = {}
    for config in configs:
        if config.t2 == t2 and config.packing not in packed:
            packed[config.packing] = BlocksWeight.from_decomposition(decomposition, config, "cpu")
    return pickle.dumps((decomposition.report.as_dict(), packed))


def all_configs(spec: ConvSpec) -> Dict[str, list]:
    from sparsecnn.kernels.triton.blocks_conv import candidate_configs

    return {mode: candidate_configs(spec, dtype, precision) for mode, (dtype, precision) in MODES.items()}


def start_workers(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """Spawned processes with one BLAS/OpenMP thread each (set before they import numpy/torch)."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


# --- GPU timing -------------------------------------------------------------------------------

def time_ms(fn, args) -> float:
    return benchmark(fn, "cuda", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)["median_ms"]


def cudnn_fn(x32, w32, b32, spec: ConvSpec, mode: str):
    """cuDNN in `mode`: fp16 channels_last (its fastest), fp32 NCHW with TF32 off, or TF32 on."""
    if mode == "fp16":
        layout = torch.channels_last
        x, w, b = (x32.to(torch.float16, memory_format=layout), w32.to(torch.float16, memory_format=layout),
                   b32.half())
    else:
        x, w, b = x32, w32, b32
    tf32 = mode == "tf32"

    def run():
        torch.backends.cudnn.allow_tf32 = tf32
        return F.conv2d(x, w, b, spec.stride, spec.padding)

    return run


def bench_mode(mode: str, spec: ConvSpec, x, bias, ref, packed: Dict[Packing, object], configs, args) -> List[dict]:
    """One record per candidate config of `mode`: median_ms and rel_err (on the reference's images),
    or the error that stopped it."""
    from sparsecnn.kernels.triton.blocks_conv import blocks_conv2d

    records = []
    for config in configs:
        weight = packed[config.packing]
        fn = lambda: blocks_conv2d(x, weight, bias, spec.stride, spec.padding, config)  # noqa: E731
        record = {"config": dataclasses.asdict(config), "plan": weight.stats}
        try:
            record["rel_err"] = relative_error(fn()[:ref.shape[0]], ref)
            record["median_ms"] = time_ms(fn, args)
        except Exception as exc:  # noqa: BLE001  (a config the GPU refuses is reported, not fatal)
            record.update(median_ms=None, error=f"{type(exc).__name__}: {exc}"[:300])
        records.append(record)
    return records


def bench_layer(suite: str, spec: ConvSpec, weight: torch.Tensor, reports: Dict[int, dict],
                packed_cpu: Dict[Packing, object], configs: Dict[str, list], args, out) -> None:
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    w32 = weight.cuda()
    x32 = torch.randn(spec.input_shape, device="cuda", generator=gen)
    b32 = torch.randn(spec.K, device="cuda", generator=gen) * 0.1
    cudnn_ms = {mode: time_ms(cudnn_fn(x32, w32, b32, spec, mode), args) for mode in MODES}
    packed = {key: value.to("cuda") for key, value in packed_cpu.items()}
    base = dict(suite=suite, **spec.as_dict(), nnz=int(torch.count_nonzero(weight)),
                gpu=torch.cuda.get_device_name(), **{f"cudnn_{m}_ms": ms for m, ms in cudnn_ms.items()})
    # fp64 references of the first few images only: a full fp64 batch of a VGG layer costs minutes.
    images = min(spec.N, args.ref_images)
    refs = {}
    for mode, (dtype, _) in MODES.items():
        if mode not in args.modes:
            continue
        x, bias = x32.to(dtype), b32.to(dtype)
        if dtype not in refs:
            refs[dtype] = F.conv2d(x[:images].double(), w32.to(dtype).double(), bias.double(), spec.stride,
                                   spec.padding)
        ref = refs[dtype]
        cudnn_err = relative_error(cudnn_fn(x32, w32, b32, spec, mode)()[:images], ref)
        row = dict(base, mode=mode)
        out.write(json.dumps(dict(row, backend="cudnn", config=None, median_ms=cudnn_ms[mode], rel_err=cudnn_err)) + "\n")
        records = bench_mode(mode, spec, x, bias, ref, packed, configs[mode], args)
        for record in records:
            record["blocks"] = reports[record["config"]["t2"]]
            out.write(json.dumps(dict(row, backend="blocks", **record)) + "\n")
        out.flush()
        print_summary(row, records, cudnn_err)
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.empty_cache()


def print_summary(row: dict, records: List[dict], cudnn_err: float) -> None:
    head = (f"{row['suite']:<13} {row['layer']:<22} N={row['N']:<4} {row['mode']:<4} "
            f"cudnn16={row['cudnn_fp16_ms']:.4f} cudnn32={row['cudnn_fp32_ms']:.4f} tf32={row['cudnn_tf32_ms']:.4f}")
    ran = [r for r in records if r.get("median_ms") is not None]
    if not ran:
        print(f"{head}  blocks: no config ran ({records[0].get('error') if records else 'none'})", flush=True)
        return
    best = min(ran, key=lambda r: r["median_ms"])
    c, b, ms = best["config"], best["blocks"], best["median_ms"]
    label = f"t2={c['t2']}/m{c['block_m']}/n{c['block_n']}/k{c['block_kred']}/w{c['num_warps']}/s{c['num_stages']}"
    print(f"{head}  blocks={ms:.4f} [{label}] x{row['cudnn_fp16_ms'] / ms:.2f} vs fp16, "
          f"x{row['cudnn_fp32_ms'] / ms:.2f} vs fp32, x{row['cudnn_tf32_ms'] / ms:.2f} vs tf32 | "
          f"{b['num_blocks']} blocks/{b['num_levels']} levels, share={b['share_in_blocks']:.2f}, "
          f"fill={b['fill']:.2f}, tile fill={best['plan']['dense_fill']:.2f} | err={best['rel_err']:.1e} "
          f"(cudnn {cudnn_err:.1e}), {len(ran)}/{len(records)} configs ran", flush=True)


# --- driver -----------------------------------------------------------------------------------

def selected_layers(suite: str, args) -> List[ConvSpec]:
    specs = get_suite(suite, args.batch or SUITE_BATCH.get(suite))
    if args.quick:
        specs = [s for s in specs if s.name in QUICK_LAYERS.get(suite, [specs[0].name])]
    if args.layers:
        specs = [s for s in specs if any(name in s.name for name in args.layers)]
    return specs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=["resnet50", "pietron-vgg16"])
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: 32 resnet50, 128 vgg)")
    parser.add_argument("--quick", action="store_true", help="only a few layers per suite")
    parser.add_argument("--layers", nargs="*", default=None, help="only layers whose name contains one of these")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--sparsity", type=float, default=0.9, help="random suites' sparsity")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--warmup-ms", type=float, default=5.0)
    parser.add_argument("--rep-ms", type=float, default=20.0)
    parser.add_argument("--ref-images", type=int, default=2, help="images checked against fp64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines output path")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_blocks.py needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    layers = [(suite, spec) for suite in args.suites for spec in selected_layers(suite, args)]
    weights = [layer_weight(suite, spec, args.sparsity, args.seed) for suite, spec in layers]
    configs = [all_configs(spec) for _, spec in layers]
    t2_values = [sorted({c.t2 for mode in args.modes for c in cfg[mode]}) for cfg in configs]
    with start_workers(args.workers) as pool, args.out.open("a") as out:
        # Submit everything first: the workers extract and pack ahead while the GPU times.
        futures = [{t2: pool.submit(pack_layer, weight, t2, [c for m in args.modes for c in cfg[m]])
                    for t2 in t2s} for weight, cfg, t2s in zip(weights, configs, t2_values)]
        for (suite, spec), weight, cfg, pending in zip(layers, weights, configs, futures):
            reports, packed = {}, {}
            for t2, future in pending.items():
                reports[t2], packs = pickle.loads(future.result())
                packed.update(packs)
            bench_layer(suite, spec, weight, reports, packed, cfg, args, out)
    print(f"done: {len(layers)} layers in {time.perf_counter() - start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
