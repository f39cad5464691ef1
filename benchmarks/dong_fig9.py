"""Dong et al. (paper 002) Sec. 3.3 / Fig. 9: our fastest sparse kernel against structured pruning run
densely by cuDNN, on the 10 layers of the `dong` suite.

Structured pruning as the paper compares it: PC deletes half the input channels (C/2), PF half the
filters (K/2), Both both halves; each is a smaller dense layer, run by cuDNN (`F.conv2d`,
cudnn.benchmark on). Against PC and PF (50% of the weights removed) the paper puts its code at
unstructured sparsity 0.5, against Both (75% removed) at 0.8: here "ours" is the fastest of our
sparse backends and their configs on the full layer at that sparsity (random mask, values as
`bench layers` draws them), timed by `sparsecnn.bench.bench_layers` (the same candidates
`sparsecnn bench layers --configs ...` times). Layers whose input channel count is odd
(lenet-conv1, alexnet-conv1, vgg-conv1: 1 or 3 channels) keep their inputs, as in the paper: no PC
row, and Both halves the filters only (its structured layer is PF's; ours still at 0.8).

Usage (GPU machine; `source scripts/device-env.sh` sets PYTHONPATH; no TRITON_INTERPRET):
    python benchmarks/dong_fig9.py OUT.jsonl N DTYPE [--backends a,b] [--layers l1,l2]
        [--configs auto|default|all|refine] [--raw RAW.jsonl] [--plot PNG] [--budget-s S]
        [--warmup-ms 10] [--rep-ms 40] [--max-rep 100] [--mode gpu|eager] [--seed 0] [--no-prefetch]
    python benchmarks/dong_fig9.py OUT.jsonl --replot [--run ID] [--plot PNG]   (table/plot of saved rows)
CPU smoke check (tiny shapes, Triton kernels in the interpreter):
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/dong_fig9.py OUT.jsonl 1 fp32 --device cpu --smoke
N: the batch (the paper: 64 and 1). DTYPE: fp32 (TF32 off everywhere; candidates whose config rounds
to TF32 are left out), tf32 (cuDNN with TF32; the sparse candidates as `bench layers` runs them at
tf32), fp16, bf16. --backends: default every registered backend that is neither dense cuDNN nor an
im2col baseline (codegen, direct, blocks, staged, unrolled); one that cannot run a layer (or fails
on it) is left out of that layer with a note. --configs: "auto" (those `backend="auto"` tries, as
`bench layers --configs auto`), "default" (each backend's default), "all" (every candidate), or
"refine" (every backend's default, then the auto configs of the fastest one). In fp32, `blocks`
offers `auto` only TF32 configs, so it competes through its default (3xTF32) under "default" and
"refine" alone. A backend is timed by one `bench_layers` call per layer and sparsity: a config that
fails drops that backend from the layer. Candidates whose rel_err exceeds REL_ERR_LIMIT[DTYPE]
never count as the best. --budget-s: start no layer after
that many seconds (rows are appended per layer, so a run cut short keeps the layers it finished).
--smoke: layers lenet-conv1 and alexnet-conv3 (unless --layers) with inputs of at most 8x8, timing
by a few calls. On CPU the "cuDNN" rows are PyTorch's CPU convolution and only fp32 runs.

Rows (JSON lines appended to OUT): every field of the results schema (`bench.schema.FIELDS`: run,
environment, suite "dong", layer, the shape measured, dtype, sparsity, pattern, backend, config, mode,
median_ms, p20_ms, p80_ms, rel_err against fp64, floor_ms) with kind "dong-fig9" and:
  variant "Dense" | "PC" | "PF" | "Both"; role "dense" (cuDNN on the full layer: Fig. 9's
  normaliser), "structured-dense" (cuDNN on the pruned shape: C and K are the pruned layer's,
  sparsity the share of the full layer's weights removed, pattern "structured-pc|pf|both") or
  "sparse-best" (the fastest candidate on the full layer at sparsity 0.5 / 0.8, pattern "random";
  PC and PF share one measurement); full_C, full_K: the full layer's channels; candidates: every
  (backend, config) timed for a sparse-best row, with its median_ms and rel_err; speedup:
  structured-dense ms / sparse-best ms of the variant (on both rows of a pair; >1: the sparse kernel
  wins); dense_ms: the Dense row's time.
--raw RAW.jsonl: every measurement (each candidate, each cuDNN run) as schema-valid layer rows.
Prints per layer and variant both times and the speedup, the geomean (and mean) speedup per variant
beside the paper's averages (N=64: 1.3x / 2.1x / 2.1x over PC / PF / Both; N=1: 1.3x / 2.1x / 1.5x).
--plot PNG (needs matplotlib): grouped bars per layer shaped like Fig. 9, every bar normalised to
cuDNN on the full layer (>1: faster than dense): PC, PF, Both (cuDNN on the pruned layers) and ours
at 0.5 and 0.8.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
import types
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

from sparsecnn.backends import backend_names, get_backend
from sparsecnn.bench import bench_layers, write_jsonl
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import free_memory, round_to
from sparsecnn.bench.patterns import make_weight
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.bench.schema import DTYPES, FIELDS, torch_dtype
from sparsecnn.core.reference import reference_conv
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers.suites import get_suite
from sparsecnn.tuning.precision import uses_tf32
from sparsecnn.tuning.select import DENSE_BACKENDS

SUITE, KIND, PATTERN = "dong", "dong-fig9", "random"
VARIANTS = ("PC", "PF", "Both")
SPARSITY = {"PC": 0.5, "PF": 0.5, "Both": 0.8}  # the paper's code at 0.5 against PC/PF, 0.8 against Both
# Fig. 9's averages: speedup of the paper's generated code over cuDNN on the structurally pruned layer
PAPER = {64: {"PC": 1.3, "PF": 2.1, "Both": 2.1}, 1: {"PC": 1.3, "PF": 2.1, "Both": 1.5}}
REL_ERR_LIMIT = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}
CANDIDATE_KEYS = ("backend", "config", "median_ms", "rel_err")
SMOKE_LAYERS = ("lenet-conv1", "alexnet-conv3")
SMOKE_HW = 8


def our_backends() -> List[str]:
    """The sparse backends of this library: every registered one but dense cuDNN and the im2col baselines."""
    return [name for name in backend_names() if name not in DENSE_BACKENDS and not name.startswith("im2col")]


def structured_shapes(spec: ConvSpec) -> Dict[str, Tuple[int, int]]:
    """variant -> (C', K') of the structurally pruned layer. Odd input channel counts are kept (the
    paper skips PC on its 1- and 3-channel layers; Both then halves the filters only)."""
    halve_c = spec.C % 2 == 0
    shapes = {}
    if halve_c:
        shapes["PC"] = (spec.C // 2, spec.K)
    if spec.K >= 2:
        shapes["PF"] = (spec.C, spec.K // 2)
        shapes["Both"] = (spec.C // 2 if halve_c else spec.C, spec.K // 2)
    return shapes


def removed_share(spec: ConvSpec, c: int, k: int) -> float:
    """Share of the full layer's weights a structured pruning to (c, k) removes."""
    return 1.0 - (c * k) / (spec.C * spec.K)


# --- dense cuDNN rows ------------------------------------------------------------------------------
def _layer_data(spec: ConvSpec, seed: int, dtype: str, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Input and dense weight of the full layer (float32, rounded to dtype's precision); the pruned
    layers use their leading channels and filters."""
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{spec.name}/fig9-input".encode()))
    x = torch.randn(spec.input_shape, generator=generator, device=device)
    weight, _ = make_weight(spec, 0.0, PATTERN, seed, device)
    return round_to(x, dtype), round_to(weight, dtype)


def dense_row(spec: ConvSpec, x: torch.Tensor, weight: torch.Tensor, c: int, k: int, pattern: str,
              ctx: "Context") -> Optional[Dict[str, Any]]:
    """Schema row of cuDNN on the layer cut to c input channels and k filters (None: out of memory)."""
    pruned = dataclasses.replace(spec, C=c, K=k)
    xs, ws = x[:, :c].contiguous(), weight[:k, :c].contiguous()
    assert tuple(xs.shape) == pruned.input_shape and tuple(ws.shape) == pruned.weight_shape
    ref = reference_conv(xs, ws, None, stride=spec.stride, padding=spec.padding, dilation=spec.dilation,
                         groups=spec.groups, fp64=True)
    stats = measure_or_none(lambda: cudnn_fn(xs, ws, pruned, ctx.dtype), ref, ctx.device, ctx.dtype, ctx.timing,
                            f"{spec.name}: cuDNN {c}x{k}")
    if stats is None:
        return None
    row = {**ctx.base, "kind": "layer", **pruned.as_dict(), "dtype": ctx.dtype,
           "sparsity": removed_share(spec, c, k), "pattern": pattern, "backend": "cudnn", "config": None,
           **stats, "floor_ms": floor_ms(pruned, 1.0, ctx.dtype, ctx.ceilings)}
    return {name: row[name] for name in FIELDS}


# --- sparse candidates (bench_layers) ------------------------------------------------------------
def _bench(spec: ConvSpec, sparsity: float, backends: Sequence[str], configs: str, ctx: "Context") -> List[dict]:
    """bench_layers' rows of each of `backends` on the full layer at `sparsity`, one call per backend
    (each draws the same input and weight): one that fails (a kernel refusing the weight, a compile
    error) is left out of this layer with a note, as the tuner drops a failing candidate."""
    rows = []
    for name in backends:
        try:
            rows += bench_layers([spec], suite=SUITE, sparsity=sparsity, pattern=PATTERN, dtype=ctx.dtype,
                                 backends=[name], device=ctx.device, seed=ctx.seed, run_id=ctx.base["run"],
                                 ceilings=ctx.ceilings, baselines=False, progress=False, timing=ctx.bench_timing,
                                 configs=configs, mode=ctx.mode)
        except Exception as error:  # noqa: BLE001
            free_memory(ctx.device)
            note(f"{spec.name} at {sparsity}: {name} left out: {type(error).__name__}: {error}")
    return rows


def rounds_to_tf32(row: dict) -> bool:
    """Whether the row's (backend, config) rounds fp32 products to TF32 (`tuning.precision.uses_tf32`)."""
    return uses_tf32(row["backend"], types.SimpleNamespace(**(row["config"] or {})))


def _valid(row: dict, dtype: str) -> bool:
    """Whether a candidate may count as the best: finite and accurate enough, and not rounding to TF32
    in an fp32 run."""
    if dtype == "fp32" and rounds_to_tf32(row):
        return False
    return row["rel_err"] is not None and row["rel_err"] <= REL_ERR_LIMIT[dtype]


def sparse_candidates(spec: ConvSpec, sparsity: float, ctx: "Context") -> List[dict]:
    """Every candidate timed on the full layer at `sparsity` (schema rows)."""
    if ctx.configs != "refine":
        return _bench(spec, sparsity, ctx.backends, ctx.configs, ctx)
    rows = _bench(spec, sparsity, ctx.backends, "default", ctx)
    valid = [row for row in rows if _valid(row, ctx.dtype)]
    if valid:
        fastest = min(valid, key=lambda row: row["median_ms"])["backend"]
        rows += _bench(spec, sparsity, [fastest], "auto", ctx)
    return rows


def best(rows: List[dict], dtype: str, what: str) -> Optional[dict]:
    """The fastest of `rows` that may count (`_valid`); a note says which did not and why."""
    valid = [row for row in rows if _valid(row, dtype)]
    tf32 = [row["backend"] for row in rows if dtype == "fp32" and rounds_to_tf32(row)]
    inaccurate = [f"{row['backend']} ({row['rel_err']:.1e})" for row in rows
                  if row not in valid and not (dtype == "fp32" and rounds_to_tf32(row))]
    if tf32:
        note(f"{what}: {len(tf32)} TF32 candidate(s) not counted in an fp32 run ({', '.join(sorted(set(tf32)))})")
    if inaccurate:
        note(f"{what}: not counted, rel_err above {REL_ERR_LIMIT[dtype]:g}: {', '.join(inaccurate)}")
    return min(valid, key=lambda row: row["median_ms"]) if valid else None


def prefetch(specs: Sequence[ConvSpec], ctx: "Context") -> None:
    """Start the per-weight work of every layer's candidates (codegen/unrolled compiles, blocks
    extractions) in the backends' worker processes now, on the weights bench_layers will draw."""
    stored = torch_dtype(ctx.dtype)
    for spec in specs:
        for sparsity in sorted({SPARSITY[v] for v in structured_shapes(spec)}):
            weight = round_to(make_weight(spec, sparsity, PATTERN, ctx.seed, "cpu")[0], ctx.dtype).to(stored)
            for name in ctx.backends:
                backend = get_backend(name)
                if backend.prefetch is None or backend.unsupported_reason(spec, stored, ctx.device.type) is not None:
                    continue
                try:
                    if ctx.configs in ("default", "refine"):
                        configs = [backend.default_config(spec, stored)]
                    elif ctx.configs == "all" or backend.auto_configs is None:
                        configs = backend.configs(spec, stored)
                    else:
                        configs = None  # the backend's auto configs
                    backend.prefetch(spec, weight, stored, False, configs=configs)
                except Exception as error:  # noqa: BLE001  (binding then does the work, or fails, itself)
                    note(f"{spec.name}: {name} prefetch failed: {error}")


# --- one layer -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    base: Dict[str, Any]
    dtype: str
    device: torch.device
    seed: int
    mode: str
    timing: Dict[str, Any]  # for measure / tuning.benchmark
    bench_timing: Dict[str, Any]  # for bench_layers (which adds hide_launch itself)
    ceilings: Dict[str, float]
    backends: List[str]
    configs: str


def _fig_row(row: dict, **extra) -> dict:
    return {**row, "kind": KIND, **extra}


def bench_layer(spec: ConvSpec, ctx: Context) -> Tuple[List[dict], List[dict]]:
    """(Fig. 9 rows, raw schema rows) of one layer."""
    shapes = structured_shapes(spec)
    x, weight = _layer_data(spec, ctx.seed, ctx.dtype, ctx.device)
    raw: List[dict] = []
    full = dict(full_C=spec.C, full_K=spec.K)
    dense = dense_row(spec, x, weight, spec.C, spec.K, "dense", ctx)
    dense_ms = dense["median_ms"] if dense else None
    out = [_fig_row(dense, variant="Dense", role="dense", **full, candidates=None, speedup=None,
                    dense_ms=dense_ms)] if dense else []
    raw += [dense] if dense else []
    structured = {}
    for variant, (c, k) in shapes.items():
        structured[variant] = dense_row(spec, x, weight, c, k, f"structured-{variant.lower()}", ctx)
        raw += [structured[variant]] if structured[variant] else []
    del x, weight
    free_memory(ctx.device)
    sparse = {}
    for sparsity in sorted({SPARSITY[v] for v in shapes}):
        rows = sparse_candidates(spec, sparsity, ctx)
        raw += rows
        sparse[sparsity] = (best(rows, ctx.dtype, f"{spec.name} at {sparsity}"),
                            [{key: row[key] for key in CANDIDATE_KEYS} for row in rows])
    for variant in shapes:
        pruned, (winner, candidates) = structured[variant], sparse[SPARSITY[variant]]
        speedup = pruned["median_ms"] / winner["median_ms"] if pruned and winner else None
        extra = dict(variant=variant, **full, speedup=speedup, dense_ms=dense_ms)
        if pruned:
            out.append(_fig_row(pruned, role="structured-dense", candidates=None, **extra))
        if winner:
            out.append(_fig_row(winner, role="sparse-best", candidates=candidates, **extra))
    return out, raw


# --- report ----------------------------------------------------------------------------------------
def _geomean(values: List[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _pairs(rows: List[dict]) -> Dict[str, Dict[str, Dict[str, dict]]]:
    """layer -> variant -> role -> row (the last one of each)."""
    table: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for row in rows:
        table.setdefault(row["layer"], {}).setdefault(row["variant"], {})[row["role"]] = row
    return table


def report(rows: List[dict]) -> str:
    """Per layer and variant: cuDNN on the pruned layer, our best sparse kernel, the speedup; then the
    geomean per variant against the paper's averages."""
    if not rows:
        return "no rows"
    first = rows[0]
    lines = [f"Dong Fig. 9 on {first['device']}, N={first['N']}, {first['dtype']}, mode {first['mode']} "
             f"(run {first['run']})",
             f"{'layer':14} {'variant':7} {'pruned CxK':>10} {'cuDNN pruned ms':>15} {'ours ms':>10} "
             f"{'sparsity':>8}  {'speedup':>7}  ours = backend config"]
    speedups: Dict[str, List[float]] = {variant: [] for variant in VARIANTS}
    for layer, variants in _pairs(rows).items():
        for variant in VARIANTS:
            pair = variants.get(variant)
            if pair is None:
                lines.append(f"{layer:14} {variant:7} {'(skipped: odd input channel count)':>40}")
                continue
            pruned, ours = pair.get("structured-dense"), pair.get("sparse-best")
            shape = f"{pruned['C']}x{pruned['K']}" if pruned else "-"
            pruned_ms = f"{pruned['median_ms']:.4f}" if pruned else "-"
            ours_ms = f"{ours['median_ms']:.4f}" if ours else "-"
            speedup = pruned["median_ms"] / ours["median_ms"] if pruned and ours else None
            if speedup is not None:
                speedups[variant].append(speedup)
            config = "" if ours is None else f"{ours['backend']} {json.dumps(ours['config'])}"
            lines.append(f"{layer:14} {variant:7} {shape:>10} {pruned_ms:>15} {ours_ms:>10} "
                         f"{SPARSITY[variant]:>8}  {(f'{speedup:.2f}x' if speedup else '-'):>7}  {config}")
    paper = PAPER.get(first["N"])
    lines.append(f"speedup of ours over cuDNN on the structurally pruned layer (paper, N={first['N']}: "
                 f"{'its Fig. 9 averages' if paper else 'no figure at this batch; N=64 shown'})")
    paper = paper or PAPER[64]
    for variant in VARIANTS:
        values = speedups[variant]
        if values:
            lines.append(f"  {variant:4}: geomean {_geomean(values):.2f}x, mean {statistics.mean(values):.2f}x, "
                         f"min {min(values):.2f}x, max {max(values):.2f}x over {len(values)} layers "
                         f"(paper: {paper[variant]:.1f}x)")
        else:
            lines.append(f"  {variant:4}: no pair measured (paper: {paper[variant]:.1f}x)")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Grouped bars per layer, like Fig. 9: cuDNN on the pruned layers and ours at 0.5 / 0.8, each
    as a speedup over cuDNN on the full layer (log scale, line at 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    table = _pairs(rows)
    layers = [layer for layer, variants in table.items() if "dense" in variants.get("Dense", {})]
    series = [("PC", "structured-dense", "PC (cuDNN, C/2)"), ("PF", "structured-dense", "PF (cuDNN, K/2)"),
              ("Both", "structured-dense", "Both (cuDNN, C/2 & K/2)"),
              ("PF", "sparse-best", "ours, sparsity 0.5"), ("Both", "sparse-best", "ours, sparsity 0.8")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(layers)), 4.5))
    for index, (variant, role, label) in enumerate(series):
        xs, ys = [], []
        for position, layer in enumerate(layers):
            row = table[layer].get(variant, {}).get(role)
            if row is None and variant == "PF" and role == "sparse-best":
                row = table[layer].get("PC", {}).get(role)  # the 0.5 measurement is shared by PC and PF
            if row is not None:
                xs.append(position + (index - (len(series) - 1) / 2) * width)
                ys.append(table[layer]["Dense"]["dense"]["median_ms"] / row["median_ms"])
        ax.bar(xs, ys, width, label=label, hatch="//" if role == "sparse-best" else None)
    first = rows[0]
    ax.set_xticks(range(len(layers)), layers, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}x"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup over dense cuDNN (full layer)")
    ax.set_title(f"Dong Fig. 9: structured pruning vs ours, N={first['N']} {first['dtype']} ({first['device']})")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


# --- command line ----------------------------------------------------------------------------------
def _specs(args) -> List[ConvSpec]:
    specs = get_suite(SUITE, batch=args.batch)
    wanted = args.layers.split(",") if args.layers else (list(SMOKE_LAYERS) if args.smoke else None)
    if wanted:
        unknown = sorted(set(wanted) - {spec.name for spec in specs})
        if unknown:
            raise SystemExit(f"unknown layer(s) {', '.join(unknown)}; the dong suite has "
                             f"{', '.join(spec.name for spec in specs)}")
        specs = [spec for spec in specs if spec.name in wanted]
    if args.smoke:
        specs = [dataclasses.replace(spec, H=min(spec.H, SMOKE_HW), W=min(spec.W, SMOKE_HW)) for spec in specs]
    return specs


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="JSON-lines file the Fig. 9 rows are appended to")
    parser.add_argument("batch", type=int, nargs="?", help="N (the paper: 64 and 1)")
    parser.add_argument("dtype", nargs="?", choices=tuple(DTYPES))
    parser.add_argument("--backends", default=None, help="comma-separated sparse backends (default: all of ours)")
    parser.add_argument("--layers", default=None, help="comma-separated subset of the dong suite")
    parser.add_argument("--configs", choices=("auto", "default", "all", "refine"), default="auto")
    add_measuring_options(parser, "layer")
    parser.add_argument("--raw", default=None, help="also append every measurement as schema rows here")
    parser.add_argument("--no-prefetch", action="store_true", help="compile/extract per candidate, not ahead")
    args = parser.parse_args(argv)
    if not args.replot and (args.batch is None or args.dtype is None):
        parser.error("N and DTYPE are required unless --replot")
    return args


def _replot(args) -> None:
    rows = run_rows(args.out, KIND, args.run)
    print(report(rows))
    if args.plot:
        plot(rows, args.plot)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    if args.replot:
        return _replot(args)
    device = measuring_device(args)
    backends = args.backends.split(",") if args.backends else our_backends()
    for name in backends:
        get_backend(name)  # unknown names fail now
    measured = timing(args)
    base = {"run": new_run_id(), **environment(device), "suite": SUITE, "model": None, "mode": args.mode}
    ctx = Context(base, args.dtype, device, args.seed, args.mode,
                  {**measured, "hide_launch": args.mode == "gpu" and device.type == "cuda"}, measured,
                  measure_ceilings(device), backends, args.configs)
    specs = _specs(args)
    print(f"run {base['run']}: {len(specs)} layers, N={args.batch}, {args.dtype}, backends {','.join(backends)}, "
          f"configs {args.configs}, {device}", flush=True)
    if device.type == "cuda" and not args.no_prefetch:
        prefetch(specs, ctx)
    start, rows = time.perf_counter(), []
    for spec in specs:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            note(f"budget of {args.budget_s:.0f} s spent: {spec.name} and later layers not measured")
            break
        layer_start = time.perf_counter()
        layer_rows, raw = bench_layer(spec, ctx)
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in layer_rows)
        if args.raw:
            write_jsonl(raw, args.raw)
        rows += layer_rows
        free_memory(device)
        print(f"{spec.name}: {len(layer_rows)} rows, {len(raw)} measurements in "
              f"{time.perf_counter() - layer_start:.1f} s", flush=True)
    print(report(rows))
    print(f"{len(rows)} rows appended to {args.out}")
    if args.plot and rows:
        plot_or_note(plot, rows, args.plot)


if __name__ == "__main__":
    main()
