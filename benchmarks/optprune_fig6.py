"""OptPrune (paper 000) Sec. 4.2 / Fig. 6: time against the number of kernels K for our dense-block GEMM
and for cuDNN, on the paper's layer: K 3x3x64 kernels on a 255x255x64 input, batch 64.

The paper's point: cuDNN (and TVM) run well only when K is a multiple of 32, while its GEMM on dense
blocks (r rows split into 32 * floor(r / 32) rows plus an r mod 32 remainder kernel) is almost linear
in K. Ours is backend `blocks` given the whole dense weight as one dense block (K rows x C*R*S
columns: `extraction.provide_blocks` with a full mask, so `prepare` packs that block instead of
running Algorithm 1; no sparse remainder); its kernel cuts the K rows into tiles of block_m channels
and pads the last tile, so its steps, if any, sit at multiples of block_m. cuDNN: `F.conv2d` with
cudnn.benchmark on (on CPU: PyTorch's CPU convolution).

Usage (GPU machine; `source scripts/device-env.sh` sets PYTHONPATH; no TRITON_INTERPRET):
    python benchmarks/optprune_fig6.py OUT.jsonl [--dtype fp32] [--ks 1-64,72-256:8,...]
        [--kernel-sizes 3] [--batch 64] [--size 255] [--channels 64] [--padding same]
        [--configs default|tiles|all] [--plot PNG] [--budget-s S] [--warmup-ms 10] [--rep-ms 40] [--max-rep 100]
    python benchmarks/optprune_fig6.py OUT.jsonl --replot [--run ID] [--plot PNG]   (saved rows)
CPU smoke check (tiny shapes, the Triton kernel in the interpreter):
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/optprune_fig6.py OUT.jsonl --device cpu --smoke
--ks: comma-separated K values or ranges A-B[:STEP] (default: 1..65 by 1, 72..256 by 8, and
32m +- 1 for every multiple of 32 above 64, so that every multiple of 32 has both neighbours).
--kernel-sizes: R = S of each shape (the paper: 3; it says 1, 5 and 7 behave alike). --padding:
"same" (R // 2; the paper gives none) or an int. --configs: the `blocks` configs timed per K, the
fastest counting: "default" (what an untuned layer runs: 64-channel tiles, fewer for K < 64),
"tiles" (the default at block_m 16, 32, 64, 128 up to K's power of two: the step width is the
tile), "all" (every candidate config; t2 is moot for a given block). --dtype: fp32 (TF32 off;
`blocks` runs fp32 as 3xTF32), tf32 (cuDNN with TF32, `blocks` with precision "tf32"), fp16, bf16.
K values are run coarse to fine (multiples of 32 and their neighbours first), so a run stopped by
--budget-s or a timeout still spans the range; rows are appended per K.
--smoke: N=1, C=4, 6x6 input, K in 1, 2, 3, 16, 17, 31, 32, 33 (unless --ks), timing by a few calls.

Rows (JSON lines appended to OUT): every field of the results schema (`bench.schema.FIELDS`: run,
environment, suite "optprune-fig6", layer = the shape's label, N C K H W R S stride padding,
dtype, sparsity 0, pattern "dense", backend "cudnn" or "blocks", config, mode, median_ms, p20_ms,
p80_ms, rel_err against fp64, floor_ms) with kind "optprune-fig6" and: shape (the label,
"k3-c64-h255-n64"), candidates (blocks: every config timed at this K with its median_ms and
rel_err), tiles (blocks: channel tiles the packed weight holds), macs_per_weight (blocks:
multiply-adds per weight, padding included). Per shape it prints the least-squares line
t = a + b K of each backend with its R^2 and largest relative deviation ("linear" when within
--linear-tol), and the steps at multiples of 32: t(32m+1) / t(32m) against the median ratio of
neighbouring K elsewhere, and how often t(32m-1) > t(32m) (a multiple of 32 running faster than one
kernel fewer). --plot PNG (needs matplotlib): time against K per shape, both backends, lines at the
multiples of 32.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from figure_script import (
    add_measuring_options,
    cudnn_fn,
    measure_or_none,
    measuring_device,
    note,
    plot_or_note,
    run_rows,
    timing,
)

from sparsecnn.backends import config_to_dict, get_backend
from sparsecnn.backends.blocks.extraction import provide_blocks
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import free_memory, round_to
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.bench.schema import DTYPES, FIELDS, torch_dtype
from sparsecnn.core.reference import reference_conv
from sparsecnn.core.spec import ConvSpec
from sparsecnn.tuning.precision import tf32_variant

SUITE, KIND = "optprune-fig6", "optprune-fig6"
DEFAULT_KS = "1-65,72-256:8," + ",".join(f"{32 * m - 1},{32 * m + 1}" for m in range(3, 8)) + ",255"
SMOKE_KS = "1,2,3,16,17,31,32,33"
TILE_ROWS = (16, 32, 64, 128)
PERIOD = 32


def parse_ks(text: str) -> List[int]:
    """"1-64,72-256:8,95" -> sorted distinct K values."""
    ks = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        span, _, step = part.partition(":")
        low, _, high = span.partition("-")
        low, high, step = int(low), int(high or low), int(step or 1)
        if low < 1 or high < low or step < 1:
            raise ValueError(f"bad K range {part!r}: want K or A-B[:STEP] with 1 <= A <= B")
        ks.update(range(low, high + 1, step))
    return sorted(ks)


def coarse_to_fine(ks: Sequence[int]) -> List[int]:
    """`ks` reordered: the ends, multiples of 32 and their neighbours, multiples of 8, then the rest."""
    def rank(k: int) -> Tuple[int, int]:
        if k in (ks[0], ks[-1]) or k % PERIOD in (0, 1, PERIOD - 1):
            return 0, k
        return (1, k) if k % 8 == 0 else (2, k)

    return sorted(ks, key=rank)


# --- measurements ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    base: Dict[str, Any]
    dtype: str
    device: torch.device
    timing: Dict[str, Any]
    ceilings: Dict[str, float]
    configs: str


def blocks_configs(spec: ConvSpec, dtype: str, which: str) -> List[Any]:
    """The `blocks` configs to time for `spec` (see --configs)."""
    backend = get_backend("blocks")
    stored = torch_dtype(dtype)
    configs = backend.configs(spec, stored)
    default = configs[0]
    if which == "default":
        configs = [default]
    elif which == "tiles":
        widest = max(TILE_ROWS[0], 1 << (spec.K - 1).bit_length())
        configs = [dataclasses.replace(default, block_m=rows) for rows in TILE_ROWS if rows <= widest]
    else:  # every candidate; t2 changes nothing for a given block
        configs = list(dict.fromkeys(dataclasses.replace(config, t2=default.t2) for config in configs))
    if dtype == "tf32":
        configs = [tf32_variant(config) or config for config in configs]
    return configs


def _given_block(weight: torch.Tensor, dtype: str, config: Any):
    """Backend `blocks`' packed weight with the whole weight as one given dense block."""
    packed = get_backend("blocks").prepare(weight.to(torch_dtype(dtype)).contiguous(), config)
    if packed.decomposition.report.partitioner != "given" or len(packed.decomposition.blocks) != 1:
        raise RuntimeError("blocks did not take the given dense block")
    return packed


def _blocks_fn(x: torch.Tensor, weight: torch.Tensor, spec: ConvSpec, dtype: str, config: Any):
    """Backend `blocks` on the whole weight as one given dense block, bound as a model binds it."""
    stored = torch_dtype(dtype)
    call = get_backend("blocks").bind(_given_block(weight, dtype, config), spec, config, stored, False)
    x = x.to(stored).contiguous()
    return lambda: call(x, None, None, False)


def _schema_row(spec: ConvSpec, label: str, backend: str, config: Any, stats: Dict[str, float],
                ctx: Context) -> Dict[str, Any]:
    row = {**ctx.base, **spec.as_dict(), "layer": label, "dtype": ctx.dtype, "sparsity": 0.0, "pattern": "dense",
           "backend": backend, "config": config_to_dict(config), **stats,
           "floor_ms": floor_ms(spec, 1.0, ctx.dtype, ctx.ceilings)}
    return {**{name: row[name] for name in FIELDS}, "kind": KIND, "shape": label}


def bench_k(spec: ConvSpec, label: str, x: torch.Tensor, weight: torch.Tensor, ref: torch.Tensor,
            ctx: Context) -> List[Dict[str, Any]]:
    """The cuDNN row and the blocks row (fastest config) of the first spec.K kernels."""
    rows = []
    what = f"{label} K={spec.K}"
    stats = measure_or_none(lambda: cudnn_fn(x, weight, spec, ctx.dtype), ref, ctx.device, ctx.dtype, ctx.timing,
                            f"{what} cuDNN")
    if stats:
        rows.append({**_schema_row(spec, label, "cudnn", None, stats, ctx), "candidates": None,
                     "tiles": None, "macs_per_weight": None})
    candidates = []
    for config in blocks_configs(spec, ctx.dtype, ctx.configs):
        stats = measure_or_none(lambda: _blocks_fn(x, weight, spec, ctx.dtype, config), ref, ctx.device, ctx.dtype,
                                ctx.timing, f"{what} blocks {config}")
        if stats:
            candidates.append((config, stats))
    if candidates:
        config, stats = min(candidates, key=lambda c: c[1]["median_ms"])
        packed = _given_block(weight, ctx.dtype, config)  # the winner's packing, for its tile counts
        rows.append({**_schema_row(spec, label, "blocks", config, stats, ctx),
                     "candidates": [dict(config=config_to_dict(c), median_ms=s["median_ms"], rel_err=s["rel_err"])
                                    for c, s in candidates],
                     "tiles": int(packed.stats["tiles"]), "macs_per_weight": float(packed.stats["macs_per_nnz"])})
    return rows


def bench_shape(r: int, args, ctx: Context, ks: Sequence[int], out: str, deadline: Optional[float]) -> List[dict]:
    """Every K of one kernel size: one input, one weight of max(ks) kernels (each K takes the first K),
    one fp64 reference of all of them (each K takes its first K channels)."""
    padding = r // 2 if args.padding == "same" else int(args.padding)
    k_max = max(ks)
    full = ConvSpec(args.batch, args.channels, k_max, args.size, args.size, r, r, 1, padding)
    label = f"k{r}-c{args.channels}-h{args.size}-n{args.batch}"
    generator = torch.Generator(device=ctx.device).manual_seed(zlib.crc32(f"{args.seed}/{label}".encode()))
    x = round_to(torch.randn(full.input_shape, generator=generator, device=ctx.device), ctx.dtype)
    weight = torch.randn(full.weight_shape, generator=generator, device=ctx.device) * (2.0 / (full.C * r * r)) ** 0.5
    weight = round_to(weight, ctx.dtype)
    ref = reference_conv(x, weight, None, stride=1, padding=padding, fp64=True)
    rows = []
    for k in coarse_to_fine(ks):
        if deadline is not None and time.perf_counter() > deadline:
            note(f"{label}: budget spent before K={k}; the remaining K values not measured")
            break
        spec = dataclasses.replace(full, K=k)
        w = weight[:k].contiguous()
        provide_blocks(torch.ones(spec.weight_shape, dtype=torch.bool), [(range(k), range(full.C * r * r))])
        k_rows = bench_k(spec, label, x, w, ref[:, :k], ctx)
        with open(out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in k_rows)
        rows += k_rows
    del x, weight, ref
    free_memory(ctx.device)
    return rows


# --- analysis --------------------------------------------------------------------------------------
def linear_fit(ks: Sequence[int], ts: Sequence[float]) -> Dict[str, float]:
    """Least-squares t = a + b K: intercept, slope, r2, max_rel_dev (largest |t - fit| / fit)."""
    n = len(ks)
    mean_k, mean_t = sum(ks) / n, sum(ts) / n
    var = sum((k - mean_k) ** 2 for k in ks)
    slope = sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, ts)) / var if var else 0.0
    intercept = mean_t - slope * mean_k
    fit = [intercept + slope * k for k in ks]
    total = sum((t - mean_t) ** 2 for t in ts)
    r2 = 1.0 - sum((t - f) ** 2 for t, f in zip(ts, fit)) / total if total else 1.0
    max_rel_dev = max(abs(t - f) / f if f > 0 else float("inf") for t, f in zip(ts, fit))
    return dict(intercept=intercept, slope=slope, r2=r2, max_rel_dev=max_rel_dev)


def steps(times: Dict[int, float], period: int = PERIOD) -> Dict[str, Any]:
    """Steps at multiples of `period`: jumps t(pm+1)/t(pm); ratios t(k+1)/t(k) of the other measured
    neighbours (k >= 8, so the small-K launch floor does not count); dips: multiples m where
    t(pm - 1) > t(pm)."""
    jumps = {k: times[k + 1] / times[k] for k in times if k % period == 0 and k + 1 in times}
    others = [times[k + 1] / times[k] for k in times if k >= 8 and k % period and k + 1 in times]
    dips = [k for k in times if k % period == 0 and k - 1 in times and times[k - 1] > times[k]]
    multiples = [k for k in times if k % period == 0 and k - 1 in times]
    return dict(jumps=jumps, median_jump=statistics.median(jumps.values()) if jumps else None,
                median_other=statistics.median(others) if others else None, dips=dips, multiples=multiples)


def _series(rows: List[dict]) -> Dict[Tuple[str, str], Dict[int, float]]:
    """(shape, backend) -> K -> median_ms (the last row of each)."""
    series: Dict[Tuple[str, str], Dict[int, float]] = {}
    for row in rows:
        series.setdefault((row["shape"], row["backend"]), {})[row["K"]] = row["median_ms"]
    return series


def report(rows: List[dict], linear_tol: float) -> str:
    if not rows:
        return "no rows"
    first = rows[0]
    lines = [f"OptPrune Fig. 6 on {first['device']}, {first['dtype']} (run {first['run']})"]
    for (shape, backend), times in sorted(_series(rows).items()):
        ks = sorted(times)
        lines.append(f"{shape} {backend}: {len(ks)} K values, K={ks[0]}: {times[ks[0]]:.4f} ms ... "
                     f"K={ks[-1]}: {times[ks[-1]]:.4f} ms")
        if len(ks) >= 3:
            fit = linear_fit(ks, [times[k] for k in ks])
            verdict = "linear" if fit["max_rel_dev"] <= linear_tol else "not linear"
            lines.append(f"  fit t = {fit['intercept']:.4g} ms + K x {fit['slope']:.4g} ms: R^2 {fit['r2']:.4f}, "
                         f"max deviation {fit['max_rel_dev']:.1%} -> {verdict} (tolerance {linear_tol:.0%})")
        found = steps(times)
        if found["median_jump"] is not None:
            jumps = ", ".join(f"{k}->{k + 1}: {ratio:.2f}x" for k, ratio in sorted(found["jumps"].items()))
            other = found["median_other"]
            stepped = other is not None and found["median_jump"] > max(1.05, other + 0.03)
            lines.append(f"  at multiples of {PERIOD}: {jumps}; median {found['median_jump']:.2f}x against "
                         f"{other if other is None else f'{other:.3f}x'} between other neighbours -> "
                         f"{'steps' if stepped else 'no steps'} at multiples of {PERIOD}")
        if found["multiples"]:
            lines.append(f"  t(32m - 1) > t(32m) at K = {found['dips'] or 'none'} of {sorted(found['multiples'])}")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows)
    shapes = sorted({shape for shape, _ in series})
    fig, axes = plt.subplots(len(shapes), 1, figsize=(9, 4 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        k_max = 1
        for (name, backend), times in sorted(series.items()):
            if name == shape:
                ks = sorted(times)
                k_max = max(k_max, ks[-1])
                label = "ours (blocks, one dense block)" if backend == "blocks" else "cuDNN"
                ax.plot(ks, [times[k] for k in ks], marker=".", markersize=3, linewidth=1, label=label)
        for multiple in range(PERIOD, k_max + 1, PERIOD):
            ax.axvline(multiple, color="grey", linewidth=0.5, linestyle=":")
        ax.set_xlabel("number of kernels K")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"OptPrune Fig. 6: {shape}, {rows[0]['dtype']} ({rows[0]['device']})")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


# --- command line ----------------------------------------------------------------------------------
def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="JSON-lines file the rows are appended to")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--ks", default=None, help=f"K values (default {DEFAULT_KS}; --smoke: {SMOKE_KS})")
    parser.add_argument("--kernel-sizes", default="3", help="comma-separated R = S (the paper: 3)")
    parser.add_argument("--batch", type=int, default=None, help="N (default 64; --smoke: 1)")
    parser.add_argument("--size", type=int, default=None, help="input height = width (default 255; --smoke: 6)")
    parser.add_argument("--channels", type=int, default=None, help="input channels C (default 64; --smoke: 4)")
    parser.add_argument("--padding", default="same", help="'same' (R // 2) or an int")
    parser.add_argument("--configs", choices=("default", "tiles", "all"), default="default")
    add_measuring_options(parser, "K")
    parser.add_argument("--linear-tol", type=float, default=0.1, help="largest relative deviation called linear")
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.ks = args.ks or (SMOKE_KS if smoke else DEFAULT_KS)
    args.batch = args.batch or (1 if smoke else 64)
    args.size = args.size or (6 if smoke else 255)
    args.channels = args.channels or (4 if smoke else 64)
    return args


def _replot(args) -> None:
    rows = run_rows(args.out, KIND, args.run)
    print(report(rows, args.linear_tol))
    if args.plot:
        plot(rows, args.plot)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    if args.replot:
        return _replot(args)
    device = measuring_device(args)
    why = get_backend("blocks").unsupported_reason(ConvSpec(1, 1, 1, 1, 1, 1, 1), torch_dtype(args.dtype), device.type)
    if why is not None:
        raise SystemExit(f"{why} (on CPU its Triton kernel runs in the interpreter: TRITON_INTERPRET=1)")
    ks = parse_ks(args.ks)
    sizes = [int(r) for r in args.kernel_sizes.split(",")]
    measured = {**timing(args), "hide_launch": args.mode == "gpu" and device.type == "cuda"}
    base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": SUITE, "model": None,
            "mode": args.mode}
    ctx = Context(base, args.dtype, device, measured, measure_ceilings(device), args.configs)
    print(f"run {base['run']}: kernel sizes {sizes}, {len(ks)} K values from {ks[0]} to {ks[-1]}, N={args.batch}, "
          f"C={args.channels}, {args.size}x{args.size}, {args.dtype}, blocks configs {args.configs}, {device}",
          flush=True)
    start = time.perf_counter()
    deadline = None if args.budget_s is None else start + args.budget_s
    rows = []
    for r in sizes:
        shape_start = time.perf_counter()
        rows += bench_shape(r, args, ctx, ks, args.out, deadline)
        print(f"kernel size {r}: done in {time.perf_counter() - shape_start:.1f} s", flush=True)
    print(report(rows, args.linear_tol))
    print(f"{len(rows)} rows appended to {args.out}")
    if args.plot and rows:
        plot_or_note(plot, rows, args.plot)


if __name__ == "__main__":
    main()
