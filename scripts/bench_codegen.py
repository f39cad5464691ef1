"""Benchmark backend `codegen` (paper 002) against cuDNN fp32 on a CUDA GPU: the paper's tables.

  main   (suite "dong"):        the 10 operators at N=64 and N=1, 90% random sparsity; codegen in
                                both modes (rewrite, emit) vs cuDNN fp32 (TF32 off), same run;
  table3 (suite "dong-table3"): alexnet-conv1, resnet-conv1, vgg-conv2 at N=64, sparsity 0.1..0.9:
                                FMAs deleted and speedup over the same template with dense weights;
  table4 (suite "dong-table4"): PTX / cubin size and compile time at sparsity 0, 0.5, 0.9.

Weights are normal with exactly round(sparsity * numel) zeros at random places; bias random. All
compiles run first, in parallel (--jobs), into a fresh cache directory unless --cache is given,
so compile times are cold (but measured with that many compiles at once). A layer whose estimated
compile time exceeds --max-compile-s is skipped with the reason, and no new measurement starts
after --budget-s. Times: `sparsecnn.autotune.timing.benchmark` (CUDA events, L2 flushed, medians),
eager and replayed from a CUDA graph (no launch overhead); rel_err against an fp64 reference on
the first images of the batch.

    PYTHONPATH=src python scripts/bench_codegen.py --out codegen.jsonl [--quick]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

try:
    import sparsecnn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparsecnn.autotune.timing import benchmark
from sparsecnn.kernels import codegen
from sparsecnn.kernels.codegen import template, toolchain
from sparsecnn.kernels.reference import relative_error
from sparsecnn.layers import ConvSpec, get_suite

TABLE3_LAYERS = ("alexnet-conv1", "resnet-conv1", "vgg-conv2")
TABLE3_SPARSITY = tuple(round(0.1 * i, 1) for i in range(1, 10))
TABLE4_SPARSITY = (0.0, 0.5, 0.9)
QUICK_LAYERS = ("alexnet-conv1", "lenet-conv2", "resnet-conv1")
# Cold-compile rates measured on a 2-core x86 box with nvcc/ptxas 13.0 (resnet-conv1 template:
# 36,864 FMAs in ~10 s of nvcc; ptxas ~0.1 ms per FMA kept); used to skip layers up front.
NVCC_S_PER_FMA = 3.0e-4
PTXAS_S_PER_FMA = 1.0e-4
REF_IMAGES = 4  # images of the batch checked against the fp64 reference


@dataclasses.dataclass(frozen=True)
class Job:
    """One compiled layer and (if `timed`) its measurement."""

    table: str
    spec: ConvSpec
    sparsity: float
    config: codegen.CodegenConfig
    timed: bool

    @property
    def compile_key(self) -> Tuple:
        return self.spec.with_batch(0), self.config, self.sparsity


def exact_sparse_weight(spec: ConvSpec, sparsity: float, seed: int) -> np.ndarray:
    """(K, C, R, S) float32 with exactly round(sparsity * numel) zeros (the same for every N)."""
    rng = np.random.default_rng([seed, spec.K, spec.C, spec.H, spec.R])
    weight = rng.standard_normal(spec.weight_shape).astype(np.float32)
    weight.reshape(-1)[rng.permutation(weight.size)[:round(sparsity * weight.size)]] = 0
    return weight


def build_jobs(args) -> List[Job]:
    layers = {n: [s for s in get_suite("dong", n) if not args.quick or s.name in QUICK_LAYERS] for n in (64, 1)}
    jobs = []
    for n in (64, 1):
        for spec in layers[n]:
            default = template.default_config(spec)
            for mode in args.modes:
                jobs.append(Job("main", spec, 0.9, dataclasses.replace(default, mode=mode), True))
    table3 = [s for s in layers[64] if s.name in TABLE3_LAYERS]
    sparsities = TABLE3_SPARSITY[::4] if args.quick else TABLE3_SPARSITY
    for spec in table3:
        config = template.default_config(spec)
        jobs += [Job("table3", spec, s, config, True) for s in (0.0, *sparsities)]
    for spec in layers[64]:
        jobs += [Job("table4", spec, s, template.default_config(spec), False) for s in TABLE4_SPARSITY]
    return jobs


def estimated_compile_s(job: Job) -> float:
    plan = codegen.make_plan(job.spec, job.config)
    kept = plan.template_fmas * (1.0 - job.sparsity)
    nvcc = NVCC_S_PER_FMA * (plan.template_fmas if job.config.mode == "rewrite" else kept)
    per_slice = PTXAS_S_PER_FMA * kept + (nvcc if job.config.mode == "emit" else 0.0)
    return (nvcc if job.config.mode == "rewrite" else 0.0) + plan.n_slices * per_slice


def compile_all(jobs: List[Job], args, cache: toolchain.DiskCache) -> Tuple[Dict[Tuple, object], Dict]:
    """({compile key: CompiledConv or the error message}, {plan: template nvcc seconds}).

    Templates first (threads: nvcc runs in subprocesses), then the layers in worker processes (the
    PTX rewrite is Python); their templates are cache hits, so a layer's own report has nvcc_s 0
    in rewrite mode and the template's time is returned apart.
    """
    plans = list({codegen.make_plan(job.spec, job.config) for job in jobs if job.config.mode == "rewrite"})
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        templates = list(pool.map(lambda plan: _try(lambda: codegen.compile_template(plan, cache)), plans))
    template_s = {plan: t.nvcc_s for plan, t in zip(plans, templates) if not isinstance(t, str)}
    unique = {job.compile_key: job for job in jobs}
    spawn = multiprocessing.get_context("spawn")  # workers never touch CUDA, the parent may have
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        results = pool.map(compile_job, unique.values(), [args.seed] * len(unique), [str(cache.root)] * len(unique))
        compiled = {key: result if isinstance(result, str) else codegen.CompiledConv(*result)
                    for key, result in zip(unique, results)}
    return compiled, template_s


def compile_job(job: Job, seed: int, cache_root: str):
    """(plan, cubins, report) of one job, or the error message (runs in a worker process)."""
    weight = exact_sparse_weight(job.spec, job.sparsity, seed)
    result = _try(lambda: codegen.compile_conv(weight, job.spec, job.config, jobs=1,
                                               cache=toolchain.DiskCache(Path(cache_root))))
    return result if isinstance(result, str) else (result.plan, result.cubins, result.report)


def _try(fn: Callable):
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:  # a failed compile is reported, not fatal
        return f"{type(exc).__name__}: {exc}"[:500]


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Layer:
    """Input, bias and cuDNN times of one (layer, N), made once for all its jobs."""

    def __init__(self, spec: ConvSpec, args):
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        self.spec = spec
        self.x = torch.randn(spec.input_shape, device="cuda", generator=gen)
        self.bias = torch.randn(spec.K, device="cuda", generator=gen)
        self._cudnn: Optional[Tuple[float, float]] = None

    def cudnn_ms(self, weight: torch.Tensor, args) -> Tuple[float, float]:
        """(eager, graph) median ms of cuDNN fp32 (TF32 off, NCHW); dense, so once per layer."""
        if self._cudnn is None:
            spec = self.spec
            fn = lambda: F.conv2d(self.x, weight, self.bias, spec.stride, spec.padding)  # noqa: E731
            self._cudnn = (time_ms(fn, args), time_ms(graphed(fn), args))
        return self._cudnn


def time_ms(fn, args) -> float:
    return benchmark(fn, "cuda", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)["median_ms"]


def measure(job: Job, compiled, layer: Layer, args) -> dict:
    spec = layer.spec
    weight = torch.from_numpy(exact_sparse_weight(spec, job.sparsity, args.seed)).cuda()
    y = torch.full(spec.output_shape, float("nan"), device="cuda")
    compiled(layer.x, layer.bias, out=y)
    m = min(REF_IMAGES, spec.N)
    ref = F.conv2d(layer.x[:m].double(), weight.double(), layer.bias.double(), spec.stride, spec.padding)
    rel_err = relative_error(y[:m], ref)
    unwritten = int(torch.isnan(y).sum())  # y starts as NaN: every output must be written
    fn = lambda: compiled(layer.x, layer.bias, out=y)  # noqa: E731
    cudnn_ms, cudnn_graph_ms = layer.cudnn_ms(weight, args)
    median_ms, graph_ms = time_ms(fn, args), time_ms(graphed(fn), args)
    return dict(median_ms=median_ms, graph_ms=graph_ms, cudnn_ms=cudnn_ms, cudnn_graph_ms=cudnn_graph_ms,
                rel_err=rel_err, unwritten=unwritten, speedup_vs_cudnn=cudnn_ms / median_ms)


def record(job: Job, compiled, measured: Optional[dict], gpu: str, template_s: float) -> dict:
    """One JSON row; compile_s = the template's nvcc time (rewrite mode) + this layer's own compile."""
    report = compiled.report
    row = dict(
        suite={"main": "dong", "table3": "dong-table3", "table4": "dong-table4"}[job.table],
        layer=job.spec.name, N=job.spec.N, dtype="fp32", sparsity=job.sparsity, backend="codegen",
        config=dataclasses.asdict(job.config), mode=job.config.mode, gpu=gpu,
        median_ms=None, graph_ms=None, cudnn_ms=None, cudnn_graph_ms=None, rel_err=None,
        compile_s=template_s + report.compile_s, template_nvcc_s=template_s, nvcc_s=report.nvcc_s,
        rewrite_s=report.rewrite_s, ptxas_s=report.ptxas_s,
        cubin_bytes=report.cubin_bytes, ptx_bytes=report.ptx_bytes, template_ptx_bytes=report.template_ptx_bytes,
        fmas_deleted=report.fmas_deleted, fmas_kept=report.fmas_kept, template_fmas=report.template_fmas,
        slices=report.slices, registers=report.registers, spill_stores=report.spill_stores,
        spill_loads=report.spill_loads)
    row.update(measured or {})
    return row


def run(args) -> List[dict]:
    start = time.perf_counter()
    jobs, skipped = [], []
    for job in build_jobs(args):
        estimate = estimated_compile_s(job)
        if estimate > args.max_compile_s:
            skipped.append(f"{job.table} {job.spec.name} N={job.spec.N} s={job.sparsity} {job.config.mode}: "
                           f"estimated compile {estimate:.0f} s > --max-compile-s {args.max_compile_s:.0f}")
        else:
            jobs.append(job)
    cache_dir = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="sparsecnn-codegen-"))
    print(f"compiling {len({j.compile_key for j in jobs})} layer variants with {args.jobs} jobs into {cache_dir}",
          flush=True)
    compiled, template_s = compile_all(jobs, args, toolchain.DiskCache(cache_dir))
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)
    if args.compile_only:
        jobs = [dataclasses.replace(job, timed=False) for job in jobs]
    else:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    order = {}
    for job in jobs:  # a layer's jobs back to back: its tensors and cuDNN times are made once
        order.setdefault((job.spec.name, job.spec.N), len(order))
    jobs.sort(key=lambda job: order[(job.spec.name, job.spec.N)])
    rows, layer, dense_ms = [], None, {}
    with args.out.open("a") as out:
        for job in jobs:
            result = compiled[job.compile_key]
            if isinstance(result, str):
                skipped.append(f"{job.table} {job.spec.name} N={job.spec.N} s={job.sparsity}: {result}")
                continue
            measured = None
            if job.timed:
                if time.perf_counter() - start > args.budget_s:
                    skipped.append(f"{job.table} {job.spec.name} N={job.spec.N} s={job.sparsity}: over --budget-s")
                    continue
                if layer is None or layer.spec != job.spec:
                    layer = None  # one layer's tensors at a time (vgg-conv2 at N=64: ~1.6 GB each)
                    torch.cuda.empty_cache()
                    layer = Layer(job.spec, args)
                measured = measure(job, result, layer, args)
                if job.table == "table3":
                    if job.sparsity == 0.0:
                        dense_ms[job.spec.name] = measured["median_ms"]
                    elif job.spec.name in dense_ms:
                        measured.update(dense_ms=dense_ms[job.spec.name],
                                        speedup_vs_dense=dense_ms[job.spec.name] / measured["median_ms"])
            row = record(job, result, measured, gpu, template_s.get(result.plan, 0.0))
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
    for reason in skipped:
        print(f"skipped: {reason}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return rows


def print_tables(rows: List[dict]) -> None:
    main = [r for r in rows if r["suite"] == "dong" and r["median_ms"] is not None]
    print("\nmain: dong, 90% sparsity, fp32; ms (eager / graph replay), speedup = cuDNN eager / codegen eager")
    print(f"{'layer':<14} {'N':>3} {'mode':<7} {'codegen':>15} {'cuDNN':>15} {'x':>6} {'rel_err':>8} "
          f"{'compile s':>9} {'regs':>4}")
    for r in main:
        print(f"{r['layer']:<14} {r['N']:>3} {r['mode']:<7} {r['median_ms']:>7.4f}/{r['graph_ms']:<7.4f} "
              f"{r['cudnn_ms']:>7.4f}/{r['cudnn_graph_ms']:<7.4f} {r['speedup_vs_cudnn']:>6.2f} "
              f"{r['rel_err']:>8.1e} {r['compile_s']:>9.1f} {r['registers']:>4}")
    table3 = [r for r in rows if r["suite"] == "dong-table3"]
    if table3:
        print("\ntable 3: FMAs deleted / speedup over the same template with dense weights (N=64)")
        dense = {r["layer"]: r["median_ms"] for r in table3 if r["sparsity"] == 0.0 and r["median_ms"]}
        for layer in dict.fromkeys(r["layer"] for r in table3):
            cells = [f"{r['sparsity']}: {r['fmas_deleted']}/"
                     + (f"{dense[layer] / r['median_ms']:.2f}" if layer in dense and r["median_ms"] else "-")
                     for r in table3 if r["layer"] == layer and r["sparsity"] > 0]
            print(f"{layer:<14} " + "  ".join(cells))
    table4 = [r for r in rows if r["suite"] == "dong-table4"]
    if table4:
        print("\ntable 4: PTX KB / cubin KB / seconds to compile (template nvcc + rewrite + ptxas) "
              "at sparsity 0, 0.5, 0.9; template PTX KB")
        for layer in dict.fromkeys(r["layer"] for r in table4):
            mine = [r for r in table4 if r["layer"] == layer]
            cells = [f"{r['ptx_bytes'] / 1024:.0f}/{r['cubin_bytes'] / 1024:.0f}/{r['compile_s']:.1f}" for r in mine]
            print(f"{layer:<14} " + "  ".join(cells) + f"  template {mine[0]['template_ptx_bytes'] / 1024:.0f}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines output path (appended)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_LAYERS)}; fewer sparsities")
    parser.add_argument("--modes", nargs="+", default=list(template.MODES), choices=template.MODES)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--cache", default=None, help="codegen cache directory (default: a fresh temporary one)")
    parser.add_argument("--max-compile-s", type=float, default=30.0)
    parser.add_argument("--budget-s", type=float, default=330.0, help="start no measurement after this")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and report sizes and compile times only (no GPU needed)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.compile_only:
        sys.exit("bench_codegen.py needs a CUDA GPU (or --compile-only)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print_tables(run(args))


if __name__ == "__main__":
    main()
