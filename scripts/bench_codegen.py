"""Benchmark backend `codegen` (paper 002) against cuDNN and im2col on a CUDA GPU: the paper's tables.

  main   (suite "dong"):        the 10 operators at N=64 and N=1, 90% random sparsity, all in one run:
                                fp32 codegen (rewrite and emit) vs cuDNN fp32 (TF32 off, NCHW),
                                im2col-cublas and im2col-cusparse (fp32); fp16 codegen (each mode,
                                each --fp16-accumulate; "half2" once per --half-terms) vs cuDNN fp16
                                in NCHW and in channels_last;
  table3 (suite "dong-table3"): alexnet-conv1, resnet-conv1, vgg-conv2 at N=64, sparsity 0.1..0.9,
                                fp32: FMAs deleted and speedup over the same template with dense weights;
  table4 (suite "dong-table4"): fp32 PTX / cubin size and compile time at sparsity 0, 0.5, 0.9.

Weights are normal with exactly round(sparsity * numel) zeros at random places (fp16: then rounded
to half); bias and input random. Every row carries the run id and the environment (device, torch,
cuDNN, driver, commit, date); baselines get their own rows (backend "cudnn", "cudnn-channels_last",
"im2col-cublas", "im2col-cusparse"), and each codegen row the baseline times of its layer and dtype
from the same run. rel_err: against the fp64 reference on the first images of the batch, computed
from the inputs in the row's dtype; fp16 rows also give cuDNN fp16's own rel_err (the tolerance is
our error <= 2x cuDNN's). All compiles run first, in parallel (--jobs), into a fresh cache
directory unless --cache is given, so compile times are cold (but measured with that many compiles
at once). A layer whose estimated compile time exceeds --max-compile-s is skipped with the reason,
and no new measurement starts after --budget-s. Times: `sparsecnn.tuning.timing.benchmark` (CUDA
events, L2 flushed, medians), eager and replayed from a CUDA graph (no launch overhead).

    PYTHONPATH=src python scripts/bench_codegen.py --out codegen.jsonl [--quick] [--dtypes fp32 fp16]
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

from sparsecnn.tuning.timing import benchmark
from sparsecnn.backends import get_backend
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.backends.codegen import generator as codegen
from sparsecnn.core import toolchain
from sparsecnn.backends.codegen.plan import MODES
from sparsecnn.core.reference import relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers import get_suite

TABLE3_LAYERS = ("alexnet-conv1", "resnet-conv1", "vgg-conv2")
TABLE3_SPARSITY = tuple(round(0.1 * i, 1) for i in range(1, 10))
TABLE4_SPARSITY = (0.0, 0.5, 0.9)
QUICK_LAYERS = ("alexnet-conv1", "lenet-conv2", "resnet-conv1")
MAIN_SPARSITY = 0.9
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
IM2COL = ("im2col-cublas", "im2col-cusparse")
# Cold-compile rates measured on a 2-core x86 box with nvcc/ptxas 13.0 (resnet-conv1 template:
# 36,864 FMAs in ~10 s of nvcc; ptxas ~0.1 ms per FMA kept); used to skip layers up front.
NVCC_S_PER_FMA = 3.0e-4
PTXAS_S_PER_FMA = 1.0e-4
REF_IMAGES = 4  # images of the batch checked against the fp64 reference
SPEEDUPS = ("speedup_vs_cudnn", "speedup_vs_cudnn_cl", "speedup_vs_im2col_cublas", "speedup_vs_im2col_cusparse")


@dataclasses.dataclass(frozen=True)
class Job:
    """One compiled layer and (if `timed`) its measurement."""

    table: str
    spec: ConvSpec
    sparsity: float
    config: codegen.CodegenConfig
    timed: bool
    dtype: str = "fp32"

    @property
    def compile_key(self) -> Tuple:
        return self.spec.with_batch(0), self.config, self.sparsity, self.dtype

    def describe(self) -> str:
        return f"{self.table} {self.spec.name} N={self.spec.N} {self.dtype} s={self.sparsity} {self.config.mode}"


def exact_sparse_weight(spec: ConvSpec, sparsity: float, seed: int) -> np.ndarray:
    """(K, C, R, S) float32 with exactly round(sparsity * numel) zeros (the same for every N)."""
    rng = np.random.default_rng([seed, spec.K, spec.C, spec.H, spec.R])
    weight = rng.standard_normal(spec.weight_shape).astype(np.float32)
    weight.reshape(-1)[rng.permutation(weight.size)[:round(sparsity * weight.size)]] = 0
    return weight


def fp16_configs(spec: ConvSpec, args) -> List[codegen.CodegenConfig]:
    """The float16 variants of the main table: each accumulation (half2 once per --half-terms), each mode."""
    configs = []
    for accumulate in args.fp16_accumulate:
        default = codegen.default_config(spec, accumulate=accumulate)
        terms = args.half_terms if accumulate == "half2" else [default.half_terms]
        configs += [dataclasses.replace(default, mode=mode, half_terms=t) for t in terms for mode in args.modes]
    return configs


def build_jobs(args) -> List[Job]:
    layers = {n: [s for s in get_suite("dong", n) if not args.quick or s.name in QUICK_LAYERS] for n in (64, 1)}
    jobs = []
    for n in (64, 1):
        for spec in layers[n]:
            if "fp32" in args.dtypes:
                default = codegen.default_config(spec)
                jobs += [Job("main", spec, MAIN_SPARSITY, dataclasses.replace(default, mode=mode), True)
                         for mode in args.modes]
            if "fp16" in args.dtypes:
                jobs += [Job("main", spec, MAIN_SPARSITY, config, True, "fp16") for config in fp16_configs(spec, args)]
    if "fp32" not in args.dtypes or args.main_only:
        return jobs
    table3 = [s for s in layers[64] if s.name in TABLE3_LAYERS]
    sparsities = TABLE3_SPARSITY[::4] if args.quick else TABLE3_SPARSITY
    for spec in table3:
        config = codegen.default_config(spec)
        jobs += [Job("table3", spec, s, config, True) for s in (0.0, *sparsities)]
    for spec in layers[64]:
        jobs += [Job("table4", spec, s, codegen.default_config(spec), False) for s in TABLE4_SPARSITY]
    return jobs


def job_plan(job: Job, seed: int) -> codegen.KernelPlan:
    """The plan `compile_conv` makes for `job` (half2 partials follow the weight's density)."""
    weight = exact_sparse_weight(job.spec, job.sparsity, seed)
    return codegen.prepare_weight(weight, job.spec, job.config, dtype=DTYPES[job.dtype])[1]


def estimated_compile_s(job: Job, seed: int) -> float:
    plan = job_plan(job, seed)
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
    plans = list({job_plan(job, args.seed) for job in jobs if job.config.mode == "rewrite"})
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
    result = _try(lambda: codegen.compile_conv(weight, job.spec, job.config, jobs=1, dtype=DTYPES[job.dtype],
                                               cache=toolchain.DiskCache(Path(cache_root))))
    return result if isinstance(result, str) else (result.plan, result.cubins, result.report)


def _try(fn: Callable):
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:  # a failed compile or baseline is reported, not fatal
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


def time_ms(fn, args) -> float:
    return benchmark(fn, "cuda", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)["median_ms"]


class Layer:
    """Inputs, bias and baseline measurements of one (layer, N), made once for all its jobs.

    baselines[dtype][name] = {median_ms, graph_ms, rel_err} (or {error}) for the main table's
    weight (sparsity MAIN_SPARSITY); cuDNN's time does not depend on the weight's values.
    """

    def __init__(self, spec: ConvSpec, args):
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        self.spec, self.args = spec, args
        self.x = torch.randn(spec.input_shape, device="cuda", generator=gen)
        self.bias = torch.randn(spec.K, device="cuda", generator=gen)
        self.baselines: Dict[str, Dict[str, dict]] = {}
        self._inputs: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}

    def inputs(self, dtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """x and bias in `dtype` (converted once)."""
        if dtype not in self._inputs:
            self._inputs[dtype] = self.x.to(DTYPES[dtype]), self.bias.to(DTYPES[dtype])
        return self._inputs[dtype]

    def weight(self, sparsity: float, dtype: str) -> torch.Tensor:
        return torch.from_numpy(exact_sparse_weight(self.spec, sparsity, self.args.seed)).to("cuda", DTYPES[dtype])

    def reference(self, weight: torch.Tensor, dtype: str) -> torch.Tensor:
        """fp64 conv of the first REF_IMAGES images of the inputs in `dtype` (fp16: half-rounded)."""
        x, bias = self.inputs(dtype)
        m = min(REF_IMAGES, self.spec.N)
        return F.conv2d(x[:m].double(), weight.double(), bias.double(), self.spec.stride, self.spec.padding)

    def measure_baselines(self, dtype: str, im2col: bool) -> Dict[str, dict]:
        """The baselines of `dtype` (cuDNN, fp16 also in channels_last; im2col if asked), each measured once."""
        names = ["cudnn"] + (["cudnn-channels_last"] if dtype == "fp16" else []) + (list(IM2COL) if im2col else [])
        measured = self.baselines.setdefault(dtype, {})
        missing = [name for name in names if name not in measured]
        if missing:
            spec, (x, bias) = self.spec, self.inputs(dtype)
            weight = self.weight(MAIN_SPARSITY, dtype)
            reference = self.reference(weight, dtype)
            for name in missing:
                if name.startswith("cudnn"):
                    fmt = torch.channels_last if name == "cudnn-channels_last" else torch.contiguous_format
                    xf, wf = x.to(memory_format=fmt), weight.to(memory_format=fmt)
                    fn = lambda: F.conv2d(xf, wf, bias, spec.stride, spec.padding)  # noqa: E731
                else:
                    fn = self._backend_call(name, x, weight, bias)
                measured[name] = self._measure(fn, reference, graph=name.startswith("cudnn"))
        return {name: measured[name] for name in names}

    def _backend_call(self, name: str, x, weight, bias) -> Callable[[], torch.Tensor]:
        backend = get_backend(name)
        packed = backend.prepare(weight, None)
        return lambda: backend.run(x, packed, bias, self.spec, None)

    def _measure(self, fn: Callable[[], torch.Tensor], reference: torch.Tensor, graph: bool) -> dict:
        """{median_ms, graph_ms (None unless `graph`), rel_err} of `fn`, or {error}."""
        try:
            rel_err = relative_error(fn()[:reference.shape[0]], reference)
            return dict(median_ms=time_ms(fn, self.args), graph_ms=time_ms(graphed(fn), self.args) if graph else None,
                        rel_err=rel_err)
        except (RuntimeError, ValueError) as exc:  # e.g. im2col out of memory at N=64: reported, not fatal
            torch.cuda.empty_cache()
            return dict(error=f"{type(exc).__name__}: {exc}"[:300])


def measure(job: Job, compiled, layer: Layer, args) -> dict:
    spec = layer.spec
    x, bias = layer.inputs(job.dtype)
    weight = layer.weight(job.sparsity, job.dtype)
    y = torch.full(spec.output_shape, float("nan"), device="cuda", dtype=DTYPES[job.dtype])
    compiled(x, bias, out=y)
    reference = layer.reference(weight, job.dtype)
    rel_err = relative_error(y[:reference.shape[0]], reference)
    unwritten = int(torch.isnan(y).sum())  # y starts as NaN: every output must be written
    fn = lambda: compiled(x, bias, out=y)  # noqa: E731
    median_ms, graph_ms = time_ms(fn, args), time_ms(graphed(fn), args)
    measured = dict(median_ms=median_ms, graph_ms=graph_ms, rel_err=rel_err, unwritten=unwritten)
    main = job.table == "main"
    baselines = layer.measure_baselines(job.dtype, im2col=main and job.dtype == "fp32" and not args.no_im2col)
    for name, base in baselines.items():
        if not main and name != "cudnn":
            continue
        key = name.replace("-", "_").replace("cudnn_channels_last", "cudnn_cl")
        measured[f"{key}_ms"] = base.get("median_ms")
        measured[f"{key}_graph_ms"] = base.get("graph_ms")
        if "median_ms" in base:
            measured[f"speedup_vs_{key}"] = base["median_ms"] / median_ms
        if main and job.dtype == "fp16" and "rel_err" in base:
            measured[f"{key}_rel_err"] = base["rel_err"]
            measured[f"err_vs_{key}"] = rel_err / base["rel_err"] if base["rel_err"] else None
    return measured


def record(job: Job, compiled, measured: Optional[dict], common: dict, template_s: float) -> dict:
    """One JSON row; compile_s = the template's nvcc time (rewrite mode) + this layer's own compile."""
    report = compiled.report
    row = dict(
        common, suite={"main": "dong", "table3": "dong-table3", "table4": "dong-table4"}[job.table],
        layer=job.spec.name, N=job.spec.N, dtype=job.dtype, sparsity=job.sparsity, backend="codegen",
        config=dataclasses.asdict(job.config), mode=job.config.mode, accumulate=job.config.accumulate,
        flush_terms=report.flush_terms, median_ms=None, graph_ms=None, rel_err=None,
        compile_s=template_s + report.compile_s, template_nvcc_s=template_s, nvcc_s=report.nvcc_s,
        rewrite_s=report.rewrite_s, ptxas_s=report.ptxas_s,
        cubin_bytes=report.cubin_bytes, ptx_bytes=report.ptx_bytes, template_ptx_bytes=report.template_ptx_bytes,
        fmas_deleted=report.fmas_deleted, fmas_kept=report.fmas_kept, template_fmas=report.template_fmas,
        slices=report.slices, registers=report.registers, spill_stores=report.spill_stores,
        spill_loads=report.spill_loads)
    row.update(measured or {})
    return row


def baseline_rows(layer: Layer, common: dict) -> List[dict]:
    spec = layer.spec
    return [dict(common, suite="dong", layer=spec.name, N=spec.N, dtype=dtype, sparsity=MAIN_SPARSITY, backend=name,
                 config=None, mode=None, **measured)
            for dtype, by_name in layer.baselines.items() for name, measured in by_name.items()]


def filter_jobs(args) -> Tuple[List[Job], List[str]]:
    jobs, skipped = [], []
    for job in build_jobs(args):
        estimate = estimated_compile_s(job, args.seed)
        if estimate > args.max_compile_s:
            skipped.append(f"{job.describe()}: estimated compile {estimate:.0f} s > --max-compile-s "
                           f"{args.max_compile_s:.0f}")
        else:
            jobs.append(job)
    return jobs, skipped


def run(args) -> List[dict]:
    start = time.perf_counter()
    jobs, skipped = filter_jobs(args)
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
    common = dict(run=new_run_id(), **environment("cuda" if torch.cuda.is_available() else "cpu"))
    order = {}
    for job in jobs:  # a layer's jobs back to back: its tensors and baselines are made once
        order.setdefault((job.spec.name, job.spec.N), len(order))
    jobs.sort(key=lambda job: order[(job.spec.name, job.spec.N)])
    rows, layer, dense_ms = [], None, {}
    with args.out.open("a") as out:
        def write(row: dict) -> None:
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)

        for job in jobs:
            result = compiled[job.compile_key]
            if isinstance(result, str):
                skipped.append(f"{job.describe()}: {result}")
                continue
            measured = None
            if job.timed:
                if time.perf_counter() - start > args.budget_s:
                    skipped.append(f"{job.describe()}: over --budget-s")
                    continue
                if layer is None or layer.spec != job.spec:
                    for row in baseline_rows(layer, common) if layer else ():
                        write(row)
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
            write(record(job, result, measured, common, template_s.get(result.plan, 0.0)))
        for row in baseline_rows(layer, common) if layer else ():
            write(row)
    for reason in skipped:
        print(f"skipped: {reason}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return rows


def geomean(values: List[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def print_main(rows: List[dict]) -> None:
    main = [r for r in rows if r["suite"] == "dong" and r["backend"] == "codegen" and r["median_ms"] is not None]
    print("\nmain: dong, 90% sparsity; ms eager / graph replay; x = baseline eager / codegen eager (same run)")
    print(f"{'layer':<14} {'N':>3} {'dtype':<5} {'variant':<16} {'codegen':>15} {'cuDNN':>7} {'x':>6} {'x CL':>6} "
          f"{'x cublas':>8} {'x cusparse':>10} {'rel_err':>8} {'/cuDNN':>6} {'compile':>7} {'regs':>4}")
    for r in main:
        variant = f"{r['mode']}" + (f" {r['accumulate']}" if r["dtype"] == "fp16" else "")
        if r["accumulate"] == "half2":
            variant += f"/{r['config']['half_terms']}"
        cells = [f"{r.get(key):>{width}.2f}" if r.get(key) is not None else f"{'-':>{width}}"
                 for key, width in zip(SPEEDUPS, (6, 6, 8, 10))]
        ratio = f"{r['err_vs_cudnn']:>6.2f}" if r.get("err_vs_cudnn") is not None else f"{'-':>6}"
        cudnn = f"{r['cudnn_ms']:>7.4f}" if r.get("cudnn_ms") is not None else f"{'-':>7}"
        times = f"{r['median_ms']:>7.4f}/{r['graph_ms']:<7.4f}"
        print(f"{r['layer']:<14} {r['N']:>3} {r['dtype']:<5} {variant:<16} {times} {cudnn} {' '.join(cells)} "
              f"{r['rel_err']:>8.1e} {ratio} {r['compile_s']:>7.1f} {r['registers']:>4}")
    groups: Dict[Tuple, List[float]] = {}
    for r in main:
        for key in SPEEDUPS:
            if r.get(key):
                name = (r["N"], r["dtype"], r["mode"], r["accumulate"], r["config"]["half_terms"], key)
                groups.setdefault(name, []).append(r[key])
    print("\ngeomean speedups (N, dtype, mode, accumulate, half_terms, vs):")
    for name, values in groups.items():
        print(f"  {name}: {geomean(values):.2f} over {len(values)} layers")


def print_tables(rows: List[dict]) -> None:
    print_main(rows)
    table3 = [r for r in rows if r["suite"] == "dong-table3"]
    if table3:
        print("\ntable 3: FMAs deleted / speedup over the same template with dense weights (N=64, fp32)")
        dense = {r["layer"]: r["median_ms"] for r in table3 if r["sparsity"] == 0.0 and r["median_ms"]}
        for layer in dict.fromkeys(r["layer"] for r in table3):
            cells = [f"{r['sparsity']}: {r['fmas_deleted']}/"
                     + (f"{dense[layer] / r['median_ms']:.2f}" if layer in dense and r["median_ms"] else "-")
                     for r in table3 if r["layer"] == layer and r["sparsity"] > 0]
            print(f"{layer:<14} " + "  ".join(cells))
    table4 = [r for r in rows if r["suite"] == "dong-table4"]
    if table4:
        print("\ntable 4: PTX KB / cubin KB / seconds to compile (template nvcc + rewrite + ptxas) "
              "at sparsity 0, 0.5, 0.9; template PTX KB (fp32)")
        for layer in dict.fromkeys(r["layer"] for r in table4):
            mine = [r for r in table4 if r["layer"] == layer]
            cells = [f"{r['ptx_bytes'] / 1024:.0f}/{r['cubin_bytes'] / 1024:.0f}/{r['compile_s']:.1f}" for r in mine]
            print(f"{layer:<14} " + "  ".join(cells) + f"  template {mine[0]['template_ptx_bytes'] / 1024:.0f}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines output path (appended)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_LAYERS)}; fewer sparsities")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--fp16-accumulate", nargs="+", default=["float", "half2"], choices=["float", "half2"])
    parser.add_argument("--half-terms", nargs="+", type=int, default=[codegen.CodegenConfig().half_terms],
                        help="half2 variants: non-zero terms per half2 partial (0: the whole sum in half2)")
    parser.add_argument("--no-im2col", action="store_true", help="skip the im2col baselines")
    parser.add_argument("--main-only", action="store_true", help="skip tables 3 and 4 (their compiles too)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--cache", default=None, help="codegen cache directory (default: a fresh temporary one)")
    parser.add_argument("--max-compile-s", type=float, default=30.0)
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no measurement after this")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and report sizes and compile times only (no GPU needed)")
    args = parser.parse_args(argv)
    if any(t < 0 for t in args.half_terms):
        parser.error("--half-terms must be >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.compile_only:
        sys.exit("bench_codegen.py needs a CUDA GPU (or --compile-only)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print_tables(run(args))


if __name__ == "__main__":
    main()
