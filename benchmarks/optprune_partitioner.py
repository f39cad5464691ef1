"""OptPrune (paper 000) Figs. 8 and 10 layers: Algorithm 1's dense blocks with the hypergraph partitioner
mtkahypar against the Jaccard default, and whether hypergraph partitioning changes block fill or speed
(issue 33, item 4).

Algorithm 1 splits the kernel matrix's rows into t1 groups by hypergraph partitioning (the paper:
hMETIS; here mtkahypar, connectivity objective, or "jaccard", our default, which groups rows by the
Jaccard similarity of their column sets), takes from each group the columns holding >= t2 of its
non-zeros as a dense block, and repeats on what is left (`backends.blocks.format`). This script runs
it on every layer of ResNet-18 on CIFAR-10 (suite "optprune-resnet18-cifar", the paper's Fig. 8) and
GoogLeNet (suite "googlenet", Fig. 10) with each partitioner, the other parameters those of backend
`blocks` (t1 = B1 = B2 = 8, imbalance 3%, t2 in the values `backend="auto"` tries: 4 and 8).

Weights: the paper prunes ResNet18-8x and GoogLeNet-8x by ADMM, uniformly to 1/8 of each layer's
weights; we have no such masks, so each layer gets a uniformly random mask at the same sparsity
0.875 (`bench.patterns.make_weight`, seed 0). Our GoogLeNet is torchvision's at 224x224 (the paper's
is a CIFAR-10 one): the blocks depend on the weight's shape only, the times on the input size too.

Part 1 (CPU, deterministic apart from the seconds): per layer, partitioner and t2 the blocks' numbers:
how many, the share of the non-zeros inside them, their fill (non-zeros / cells), mean size, the
extraction's seconds, and what the kernel will compute once the blocks are packed into its tiles of
64 output channels (`kernel.BlocksWeight.stats`: tile fill, multiply-adds per non-zero).
Part 2 (--gpu): backend `blocks` timed on each layer with each partitioner's blocks at every t2 (the
fastest of its configs at those t2 values; --configs default: one config per t2), and cuDNN dense on
the same input in the same run, per dtype (default fp32 and fp16; fp32 runs as 3xTF32 in `blocks`
and with TF32 off in cuDNN), at the suite's batch (32, the paper's).

Usage (from the repository root; PYTHONPATH=src, as `source scripts/device-env.sh` sets on the GPU
machine, where TRITON_INTERPRET stays unset; mtkahypar installed, else --partitioners jaccard):
    python benchmarks/optprune_partitioner.py OUT.jsonl [--suites optprune-resnet18-cifar,googlenet]
        [--layers a,b] [--partitioners jaccard,mtkahypar] [--t2 4,8] [--sparsity 0.875] [--pattern random]
        [--seed 0] [--workers N] [--plot PNG]
    python benchmarks/optprune_partitioner.py OUT.jsonl --gpu [--dtypes fp32,fp16] [--batch N]
        [--configs all|default] [--budget-s S] [--warmup-ms 10] [--rep-ms 40] [--max-rep 100] [--mode gpu]
    python benchmarks/optprune_partitioner.py OUT.jsonl --replot [--run ID] [--plot PNG]   (saved rows)
CPU smoke check (seconds; with --gpu the Triton kernel runs in the interpreter):
    [TRITON_INTERPRET=1] PYTHONPATH=src python benchmarks/optprune_partitioner.py OUT.jsonl --smoke [--gpu --device cpu]
--workers: extractions run in that many processes (default 1; each uses one thread), all before any
timing. --budget-s: start no timed layer once that many seconds have passed since the start
(extraction included, which is never cut short): rows are appended per layer, so a run stopped
there keeps the layers it timed.
--smoke: the first two layers of each suite cut to N=1, C <= 16, K <= 64, 8x8 inputs; timing by a
few calls; on the CPU only fp32.

Rows (JSON lines appended to OUT; one run id for all), every field of the results schema
(`bench.schema.FIELDS`) and:
  kind "optprune-partitioner-blocks" (one per layer, partitioner and t2; the environment of the CPU
  that extracted; dtype "fp32", backend "blocks", config: the `BlockParams`; mode and the time
  fields null): partitioner, t2, num_blocks, num_levels, nnz, nnz_in_blocks, share_in_blocks,
  block_cells, fill, extra_flops (zeros multiplied in blocks per non-zero), mean_block_rows,
  mean_block_cols, mean_block_cells (null without blocks), seconds (extraction wall time),
  tiles, tile_fill, macs_per_nnz (the kernel's packing at the default 64-channel tile).
  kind "optprune-partitioner-time" (--gpu; valid schema rows once kind is "layer"): backend "cudnn"
  (partitioner null) or "blocks" (the fastest config whose rel_err is within REL_ERR_LIMIT[dtype]),
  partitioner, t2 (of that config), candidates (every config timed: config, median_ms, rel_err),
  cudnn_ms and speedup (cudnn_ms / median_ms) on blocks rows.
Prints per layer and t2 each partitioner's blocks, non-zeros in blocks, fill, MACs per non-zero and
seconds; with --gpu per dtype each partitioner's time and speedup over cuDNN; per suite the pooled
fill, mean share, and (--gpu) the geomean speed ratio mtkahypar / jaccard (> 1: mtkahypar faster).
--plot PNG (needs matplotlib): per suite, share in blocks and fill per layer (and speedup over cuDNN).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import pickle
import statistics
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

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
from sparsecnn.backends.blocks.backend import AUTO_T2
from sparsecnn.backends.blocks.format import BlockDecomposition, BlockParams, extract_blocks
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import free_memory, round_to
from sparsecnn.bench.patterns import layer_generator, make_weight
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.bench.schema import FIELDS, torch_dtype
from sparsecnn.core.csr import CSRWeight
from sparsecnn.core.reference import reference_conv
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers.suites import get_suite

if TYPE_CHECKING:
    from sparsecnn.backends.blocks.kernel import BlocksConfig

SUITES = ("optprune-resnet18-cifar", "googlenet")  # the paper's Figs. 8 and 10
COMPARED = ("jaccard", "mtkahypar")
SPARSITY = 0.875  # ResNet18-8x and GoogLeNet-8x: every layer keeps 1/8 of its weights
PATTERN = "random"
KIND_BLOCKS, KIND_TIME = "optprune-partitioner-blocks", "optprune-partitioner-time"
TIMED_DTYPES = ("fp32", "fp16", "bf16")
REL_ERR_LIMIT = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}  # as dong_fig9.py: a candidate beyond never counts
SMOKE_LAYERS = 2  # per suite
SMOKE_LIMITS = {"N": 1, "C": 16, "K": 64, "H": 8, "W": 8}  # K 64: t1 = 8 groups of B1 = 8 rows still fit

Layer = Tuple[str, ConvSpec]  # (suite, spec)
Key = Tuple[str, str, str, int]  # (suite, layer, partitioner, t2) of one extraction


@dataclasses.dataclass(frozen=True)
class Study:
    """What every extraction shares: the weights' sparsity, pattern and seed; the compared
    partitioners and t2 values."""

    sparsity: float
    pattern: str
    seed: int
    partitioners: Tuple[str, ...]
    t2_values: Tuple[int, ...]


# --- part 1: extraction ----------------------------------------------------------------------------
def layer_weight(spec: ConvSpec, study: Study) -> Tuple[torch.Tensor, str]:
    """The layer's pruned float32 (K, C, R, S) weight on the CPU and the label of its pattern."""
    return make_weight(spec, study.sparsity, study.pattern, study.seed, "cpu")


def extract(spec: ConvSpec, study: Study, partitioner: str, t2: int) -> BlockDecomposition:
    """Algorithm 1 on the layer's weight with `blocks`' parameters, this partitioner and t2."""
    weight, _ = layer_weight(spec, study)
    return extract_blocks(weight, BlockParams(t2=t2, partitioner=partitioner))


def _extract_pickled(spec: ConvSpec, study: Study, partitioner: str, t2: int) -> bytes:
    """`extract` in a worker process, returned as a plain pickle (torch's process pickling would hold
    a shared-memory file descriptor per tensor)."""
    return pickle.dumps(extract(spec, study, partitioner, t2))


def extract_all(layers: Sequence[Layer], study: Study, workers: int) -> Dict[Key, BlockDecomposition]:
    """Every (layer, partitioner, t2) extraction, in `workers` processes (1: in this one)."""
    jobs = [(suite, spec, partitioner, t2) for suite, spec in layers
            for partitioner in study.partitioners for t2 in study.t2_values]
    done: Dict[Key, BlockDecomposition] = {}

    def record(job, decomposition: BlockDecomposition) -> None:
        suite, spec, partitioner, t2 = job
        done[(suite, spec.name, partitioner, t2)] = decomposition
        note(f"[{len(done)}/{len(jobs)}] {spec.name} {partitioner} t2={t2}: {len(decomposition.blocks)} blocks, "
             f"{decomposition.report.seconds:.2f} s")

    if workers <= 1:
        for job in jobs:
            record(job, extract(job[1], study, *job[2:]))
        return done
    # Largest first, so that no big layer starts last; spawn: forking after CUDA started is unsafe.
    ordered = sorted(jobs, key=lambda job: -job[1].weight_numel)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_extract_pickled, job[1], study, *job[2:]): job for job in ordered}
        for future in concurrent.futures.as_completed(futures):
            record(futures[future], pickle.loads(future.result()))
    return done


def block_statistics(decomposition: BlockDecomposition) -> Dict[str, Any]:
    """Counts of the dense blocks, from the blocks themselves: num_blocks, num_levels, nnz (of the
    layer), nnz_in_blocks, share_in_blocks, block_cells, fill (nnz_in_blocks / block_cells; 0 without
    blocks), extra_flops (zeros in blocks per non-zero of the layer), mean_block_rows / _cols / _cells
    (None without blocks), seconds (the extraction's wall time)."""
    blocks = decomposition.blocks
    nnz = decomposition.report.nnz
    in_blocks = sum(int(torch.count_nonzero(block.values)) for block in blocks)
    cells = sum(block.values.numel() for block in blocks)

    def mean(values: List[int]) -> Optional[float]:
        return statistics.mean(values) if values else None

    return dict(num_blocks=len(blocks), num_levels=len({block.level for block in blocks}), nnz=nnz,
                nnz_in_blocks=in_blocks, share_in_blocks=in_blocks / nnz if nnz else 0.0, block_cells=cells,
                fill=in_blocks / cells if cells else 0.0, extra_flops=(cells - in_blocks) / nnz if nnz else 0.0,
                mean_block_rows=mean([block.rows.numel() for block in blocks]),
                mean_block_cols=mean([block.cols.numel() for block in blocks]),
                mean_block_cells=mean([block.values.numel() for block in blocks]),
                seconds=decomposition.report.seconds)


def _kernels():
    """The `blocks` kernel module, imported on first use: it imports triton, which the report and
    the extraction statistics do not need."""
    from sparsecnn.backends.blocks import kernel

    return kernel


def packing_config(spec: ConvSpec, t2: int) -> "BlocksConfig":
    """The default-tile config of `blocks` at this t2 (64 output channels, fewer for smaller K)."""
    return next(config for config in _kernels().candidate_configs(spec, torch.float16) if config.t2 == t2)


def packed_statistics(decomposition: BlockDecomposition, spec: ConvSpec) -> Dict[str, Any]:
    """What the kernel computes once the blocks are packed into its default tiles: tiles, tile_fill
    (non-zeros among the dense parts' multiply-adds) and macs_per_nnz (all multiply-adds, dense and
    sparse, per non-zero of the layer: 1 at best)."""
    stats = _kernels().BlocksWeight.from_decomposition(decomposition, packing_config(spec, decomposition.params.t2),
                                                       torch.device("cpu")).stats
    return dict(tiles=int(stats["tiles"]), tile_fill=stats["dense_fill"], macs_per_nnz=stats["macs_per_nnz"])


def blocks_row(base: Dict[str, Any], layer: Layer, label: str, study: Study,
               decomposition: BlockDecomposition) -> Dict[str, Any]:
    """The KIND_BLOCKS row of one extraction."""
    suite, spec = layer
    params = decomposition.params
    row = {**base, **spec.as_dict(), "kind": KIND_BLOCKS, "suite": suite, "dtype": "fp32", "sparsity": study.sparsity,
           "pattern": label, "backend": "blocks", "config": dataclasses.asdict(params), "mode": None, "median_ms": None,
           "p20_ms": None, "p80_ms": None, "rel_err": None, "floor_ms": None}
    return {**{name: row[name] for name in FIELDS}, "partitioner": params.partitioner,
            "t2": params.t2, **block_statistics(decomposition), **packed_statistics(decomposition, spec)}


# --- part 2: timing --------------------------------------------------------------------------------
@dataclasses.dataclass
class Timer:
    """What every timed layer shares."""

    base: Dict[str, Any]  # run id, environment of the timing device, model, mode
    device: torch.device
    dtypes: Tuple[str, ...]
    timing: Dict[str, Any]  # `tuning.benchmark` keywords
    ceilings: Dict[str, float]
    configs: str  # "all" or "default" (see --configs)
    seed: int


def rounded(decomposition: BlockDecomposition, dtype: str) -> BlockDecomposition:
    """`decomposition` with its values rounded to what dtype name `dtype` holds (still float32): the
    decomposition of the rounded weight, without extracting again. Each non-zero sits in exactly one
    block or the remainder, so rounding the parts rounds their sum."""
    if torch_dtype(dtype) == torch.float32:
        return decomposition
    blocks = tuple(dataclasses.replace(block, values=round_to(block.values, dtype)) for block in decomposition.blocks)
    remainder = CSRWeight.from_dense(round_to(decomposition.remainder.to_dense(), dtype))
    return dataclasses.replace(decomposition, blocks=blocks, remainder=remainder)


def timed_configs(spec: ConvSpec, dtype: str, t2: int, which: str) -> List["BlocksConfig"]:
    """`blocks`' candidate configs at this t2 ("default": only the first, its default tile)."""
    configs = [config for config in _kernels().candidate_configs(spec, torch_dtype(dtype)) if config.t2 == t2]
    return configs[:1] if which == "default" else configs


def _blocks_fn(x: torch.Tensor, decomposition: BlockDecomposition, spec: ConvSpec, dtype: str,
               config: "BlocksConfig"):
    """Backend `blocks` on exactly these blocks: packed for `config` and bound as a model binds it."""
    stored = torch_dtype(dtype)
    packed = _kernels().BlocksWeight.from_decomposition(decomposition, config, x.device)
    call = get_backend("blocks").bind(packed, spec, config, stored, False)
    x = x.to(stored).contiguous()
    return lambda: call(x, None, None, False)


def _measure(make_fn, ref: torch.Tensor, timer: Timer, dtype: str, what: str) -> Optional[Dict[str, float]]:
    return measure_or_none(make_fn, ref, timer.device, dtype, timer.timing, what)


def _time_row(timer: Timer, layer: Layer, label: str, sparsity: float, dtype: str, backend: str,
              config: Optional["BlocksConfig"], stats: Dict[str, float], **extra) -> Dict[str, Any]:
    suite, spec = layer
    density = 1.0 if backend == "cudnn" else 1.0 - sparsity
    row = {**timer.base, **spec.as_dict(), "kind": KIND_TIME, "suite": suite, "dtype": dtype, "sparsity": sparsity,
           "pattern": label, "backend": backend, "config": config_to_dict(config), **stats,
           "floor_ms": floor_ms(spec, density, dtype, timer.ceilings)}
    return {**{name: row[name] for name in FIELDS}, **extra}


@dataclasses.dataclass
class Operands:
    """One layer at one dtype: x (N, C, H, W) rounded to `dtype`, stored as float32 on the timing
    device; ref: its float64 output; label: the weight's pattern; cudnn_ms: cuDNN's median (None
    when it ran out of memory)."""

    x: torch.Tensor
    ref: torch.Tensor
    dtype: str
    label: str
    cudnn_ms: Optional[float]


def _fastest_blocks(layer: Layer, partitioner: str, operands: Operands, study: Study,
                    extractions: Dict[Key, BlockDecomposition], timer: Timer) -> Optional[Dict[str, Any]]:
    """The KIND_TIME row of `blocks` on this partitioner's blocks: every config at every t2 timed, the
    fastest whose rel_err is within REL_ERR_LIMIT[dtype] reported (None if there is none)."""
    suite, spec = layer
    x, ref, dtype, cudnn_ms = operands.x, operands.ref, operands.dtype, operands.cudnn_ms
    candidates = []
    for t2 in study.t2_values:
        decomposition = rounded(extractions[(suite, spec.name, partitioner, t2)], dtype)
        for config in timed_configs(spec, dtype, t2, timer.configs):
            stats = _measure(lambda: _blocks_fn(x, decomposition, spec, dtype, config), ref, timer, dtype,
                             f"{spec.name} {dtype} blocks {partitioner} {config}")
            if stats is not None:
                candidates.append((config, stats))
    accurate = [(config, stats) for config, stats in candidates if stats["rel_err"] <= REL_ERR_LIMIT[dtype]]
    if len(accurate) < len(candidates):
        note(f"{spec.name} {dtype} {partitioner}: {len(candidates) - len(accurate)} config(s) not counted, "
             f"rel_err above {REL_ERR_LIMIT[dtype]:g}")
    if not accurate:
        return None
    config, stats = min(accurate, key=lambda candidate: candidate[1]["median_ms"])
    timed = [dict(config=config_to_dict(c), median_ms=s["median_ms"], rel_err=s["rel_err"]) for c, s in candidates]
    return _time_row(timer, layer, operands.label, study.sparsity, dtype, "blocks", config, stats,
                     partitioner=partitioner, t2=config.t2, candidates=timed, cudnn_ms=cudnn_ms,
                     speedup=None if cudnn_ms is None else cudnn_ms / stats["median_ms"])


def time_layer(layer: Layer, study: Study, extractions: Dict[Key, BlockDecomposition],
               timer: Timer) -> List[Dict[str, Any]]:
    """Per dtype: cuDNN dense, then `blocks` on each partitioner's blocks (`_fastest_blocks`), all on
    one input and one float64 reference."""
    suite, spec = layer
    weight, label = layer_weight(spec, study)
    x_full = torch.randn(spec.input_shape, generator=layer_generator(timer.seed, f"{spec.name}/input"))
    rows = []
    for dtype in timer.dtypes:
        x = round_to(x_full, dtype).to(timer.device)
        w = round_to(weight, dtype).to(timer.device)
        ref = reference_conv(x, w, None, stride=spec.stride, padding=spec.padding, fp64=True)
        cudnn = _measure(lambda: cudnn_fn(x, w, spec, dtype), ref, timer, dtype, f"{spec.name} {dtype} cuDNN")
        if cudnn is not None:
            rows.append(_time_row(timer, layer, label, 0.0, dtype, "cudnn", None, cudnn, partitioner=None, t2=None,
                                  candidates=None, cudnn_ms=None, speedup=None))
        operands = Operands(x, ref, dtype, label, None if cudnn is None else cudnn["median_ms"])
        for partitioner in study.partitioners:
            row = _fastest_blocks(layer, partitioner, operands, study, extractions, timer)
            if row is not None:
                rows.append(row)
    free_memory(timer.device)
    return rows


# --- report ----------------------------------------------------------------------------------------
def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _blocks_table(rows: List[dict], partitioners: Sequence[str]) -> List[str]:
    """One line per (suite, layer, t2): each partitioner's blocks, % in blocks, fill %, MACs/nnz, s."""
    by_key = {(row["suite"], row["layer"], row["t2"], row["partitioner"]): row for row in rows}
    header = f"{'layer':28} {'KxCRS':>10} {'t2':>2}"
    for partitioner in partitioners:
        header += f" | {partitioner[:9]:>9}: {'blocks':>6} {'in%':>5} {'fill%':>5} {'MAC/nz':>6} {'s':>6}"
    lines = [header]
    for suite, layer, t2 in dict.fromkeys(key[:3] for key in by_key):
        first = next(by_key[(suite, layer, t2, p)] for p in partitioners if (suite, layer, t2, p) in by_key)
        matrix = f"{first['K']}x{first['C'] * first['R'] * first['S']}"
        line = f"{layer:28} {matrix:>10} {t2:>2}"
        for partitioner in partitioners:
            row = by_key.get((suite, layer, t2, partitioner))
            if row is None:
                line += f" | {'':9}  {'-':>6} {'-':>5} {'-':>5} {'-':>6} {'-':>6}"
                continue
            line += (f" | {'':9}  {row['num_blocks']:>6} {_pct(row['share_in_blocks']):>5} {_pct(row['fill']):>5} "
                     f"{row['macs_per_nnz']:>6.2f} {row['seconds']:>6.2f}")
        lines.append(line)
    return lines


def _blocks_summary(rows: List[dict], partitioners: Sequence[str]) -> List[str]:
    """Per suite and t2, per partitioner: pooled fill, mean share in blocks, mean MACs/nnz, seconds;
    then how mtkahypar's share and fill compare with jaccard's layer by layer."""
    lines = []
    groups: Dict[Tuple[str, int], Dict[str, Dict[str, dict]]] = {}
    for row in rows:
        groups.setdefault((row["suite"], row["t2"]), {}).setdefault(row["partitioner"], {})[row["layer"]] = row
    for (suite, t2), by_partitioner in groups.items():
        lines.append(f"{suite}, t2={t2}:")
        for partitioner in partitioners:
            layers = list(by_partitioner.get(partitioner, {}).values())
            if not layers:
                continue
            cells = sum(row["block_cells"] for row in layers)
            pooled = sum(row["nnz_in_blocks"] for row in layers) / cells if cells else 0.0
            seconds = [row["seconds"] for row in layers]
            lines.append(f"  {partitioner:9}: {len(layers)} layers, {sum(r['num_blocks'] for r in layers)} blocks, "
                         f"mean share in blocks {_pct(statistics.mean(r['share_in_blocks'] for r in layers))}%, "
                         f"pooled fill {_pct(pooled)}%, mean MACs/nnz "
                         f"{statistics.mean(r['macs_per_nnz'] for r in layers):.2f}, extraction {sum(seconds):.1f} s "
                         f"(max {max(seconds):.1f} s)")
        if set(COMPARED) <= set(by_partitioner):
            lines.append("  " + _compare_partitioners(by_partitioner["jaccard"], by_partitioner["mtkahypar"]))
    return lines


def _compare_partitioners(jaccard: Dict[str, dict], mtkahypar: Dict[str, dict]) -> str:
    """mtkahypar against jaccard on the layers both have: share and fill differences, MACs ratio."""
    layers = [layer for layer in jaccard if layer in mtkahypar]
    share = [mtkahypar[layer]["share_in_blocks"] - jaccard[layer]["share_in_blocks"] for layer in layers]
    both = [layer for layer in layers if jaccard[layer]["num_blocks"] and mtkahypar[layer]["num_blocks"]]
    fill = [mtkahypar[layer]["fill"] - jaccard[layer]["fill"] for layer in both]
    macs = [mtkahypar[layer]["macs_per_nnz"] / jaccard[layer]["macs_per_nnz"] for layer in layers]
    more = sum(delta > 0 for delta in share)
    fewer = sum(delta < 0 for delta in share)
    text = (f"mtkahypar - jaccard: share in blocks {100 * statistics.mean(share):+.1f} points on average "
            f"(range {100 * min(share):+.1f} .. {100 * max(share):+.1f}; higher on {more}, lower on {fewer} "
            f"of {len(layers)} layers)")
    if fill:
        text += f", fill {100 * statistics.mean(fill):+.1f} points ({len(both)} layers with blocks in both)"
    return text + f", MACs/nnz ratio geomean {geomean(macs):.3f}"


def _time_table(rows: List[dict], partitioners: Sequence[str]) -> List[str]:
    """Per dtype and layer: cuDNN ms, each partitioner's ms and speedup, and the speed ratio; then the
    geomeans per suite."""
    lines = []
    table: Dict[Tuple[str, str, str], Dict[str, dict]] = {}
    for row in rows:
        table.setdefault((row["dtype"], row["suite"], row["layer"]), {})[row["partitioner"] or "cudnn"] = row
    for dtype in dict.fromkeys(key[0] for key in table):
        header = f"{dtype} {'layer':23} {'cudnn ms':>9}"
        for partitioner in partitioners:
            header += f" | {partitioner[:9]:>9} ms {'t2':>2} {'x cudnn':>7}"
        lines.append(header + " | mtk/jac speed")
        ratios: Dict[str, Dict[str, List[float]]] = {}
        for (row_dtype, suite, layer), by in table.items():
            if row_dtype != dtype:
                continue
            cudnn = by.get("cudnn")
            line = f"{'':{len(dtype)}} {layer:23} {cudnn['median_ms'] if cudnn else float('nan'):>9.4f}"
            for partitioner in partitioners:
                row = by.get(partitioner)
                if row is None:
                    line += f" | {'-':>12} {'-':>2} {'-':>7}"
                    continue
                speedup = row["speedup"]
                line += f" | {row['median_ms']:>12.4f} {row['t2']:>2} {speedup if speedup else float('nan'):>6.2f}x"
                if speedup:
                    ratios.setdefault(suite, {}).setdefault(partitioner, []).append(speedup)
            if all(p in by for p in COMPARED):
                ratio = by["jaccard"]["median_ms"] / by["mtkahypar"]["median_ms"]
                ratios.setdefault(suite, {}).setdefault("ratio", []).append(ratio)
                line += f" | {ratio:.3f}"
            lines.append(line)
        for suite, values in ratios.items():
            parts = [f"{p} geomean {geomean(values[p]):.2f}x over cuDNN" for p in partitioners if values.get(p)]
            if values.get("ratio"):
                parts.append(f"speed mtkahypar / jaccard geomean {geomean(values['ratio']):.3f} "
                             f"(min {min(values['ratio']):.3f}, max {max(values['ratio']):.3f}, "
                             f"{len(values['ratio'])} layers)")
            lines.append(f"  {dtype} {suite}: " + "; ".join(parts))
    return lines


def report(blocks: List[dict], timed: List[dict]) -> str:
    if not blocks:
        return "no rows"
    partitioners = list(dict.fromkeys(row["partitioner"] for row in blocks))
    first = blocks[0]
    lines = [f"OptPrune partitioners (run {first['run']}): pattern {first['pattern']}, sparsity {first['sparsity']}, "
             f"extracted on {first['device']}",
             *_blocks_table(blocks, partitioners), *_blocks_summary(blocks, partitioners)]
    if timed:
        lines += [f"times on {timed[0]['device']}, N={timed[0]['N']}, mode {timed[0]['mode']}",
                  *_time_table(timed, partitioners)]
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Per suite: share in blocks and fill per layer for each (partitioner, t2); speedup over cuDNN
    per (partitioner, dtype) when timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = [row for row in rows if row["kind"] == KIND_BLOCKS]
    timed = [row for row in rows if row["kind"] == KIND_TIME and row["backend"] == "blocks"]
    suites = list(dict.fromkeys(row["suite"] for row in blocks))
    panels = [("share_in_blocks", "non-zeros in blocks (%)", blocks, "t2"), ("fill", "block fill (%)", blocks, "t2")]
    if timed:
        panels.append(("speedup", "speedup over cuDNN", timed, "dtype"))
    fig, axes = plt.subplots(len(suites), len(panels), figsize=(6 * len(panels), 4 * len(suites)), squeeze=False)
    for axes_row, suite in zip(axes, suites):
        layers = list(dict.fromkeys(row["layer"] for row in blocks if row["suite"] == suite))
        for ax, (field, label, source, variant) in zip(axes_row, panels):
            series: Dict[Tuple[str, Any], Dict[str, float]] = {}
            for row in source:
                no_blocks = field == "fill" and not row["num_blocks"]  # fill 0 there would read as empty blocks
                if row["suite"] == suite and row[field] is not None and not no_blocks:
                    scale = 1.0 if field == "speedup" else 100.0
                    series.setdefault((row["partitioner"], row[variant]), {})[row["layer"]] = scale * row[field]
            for (partitioner, value), by_layer in sorted(series.items(), key=lambda item: str(item[0])):
                xs = [i for i, layer in enumerate(layers) if layer in by_layer]
                ax.plot(xs, [by_layer[layers[i]] for i in xs], marker="o" if partitioner == "jaccard" else "x",
                        linestyle="-" if partitioner == "jaccard" else "--", label=f"{partitioner} {variant} {value}")
            ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=6)
            ax.set_ylabel(label)
            ax.set_title(suite)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


# --- command line ----------------------------------------------------------------------------------
def _int_list(text: str, name: str) -> Tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--{name} must be comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} must be ints >= 1, got {text!r}")
    return values


def smoke_spec(spec: ConvSpec) -> ConvSpec:
    """`spec` cut to SMOKE_LIMITS (N, C, K, H, W), the name kept."""
    cut = {field: min(getattr(spec, field), limit) for field, limit in SMOKE_LIMITS.items()}
    return dataclasses.replace(spec, **cut)


def select_layers(args: argparse.Namespace) -> List[Layer]:
    """(suite, spec) of every layer asked for (--suites, --layers, --batch; --smoke cuts them)."""
    layers = []
    for suite in args.suites.split(","):
        specs = get_suite(suite, batch=args.batch)
        if args.smoke and not args.layers:
            specs = specs[:SMOKE_LAYERS]
        layers += [(suite, smoke_spec(spec) if args.smoke else spec) for spec in specs]
    if args.layers:
        wanted = args.layers.split(",")
        unknown = sorted(set(wanted) - {spec.name for _, spec in layers})
        if unknown:
            raise SystemExit(f"--layers: unknown layer(s) {', '.join(unknown)} in suites {args.suites}")
        layers = [(suite, spec) for suite, spec in layers if spec.name in wanted]
    return layers


def _check_partitioners(names: Sequence[str]) -> None:
    unknown = sorted(set(names) - set(COMPARED))
    if unknown:
        raise SystemExit(f"--partitioners: unknown {', '.join(unknown)}; expected some of {', '.join(COMPARED)}")
    if "mtkahypar" in names and importlib.util.find_spec("mtkahypar") is None:
        raise SystemExit("--partitioners mtkahypar needs the mtkahypar package (pip install mtkahypar), "
                         "or run with --partitioners jaccard")


def _timing_device(args: argparse.Namespace) -> torch.device:
    """args.device, else cuda when available; SystemExit for half precision off CUDA or a `blocks`
    that cannot run there (on CPU: TRITON_INTERPRET unset)."""
    device = measuring_device(args, args.dtypes)
    why = get_backend("blocks").unsupported_reason(ConvSpec(1, 1, 1, 1, 1, 1, 1), torch.float32, device.type)
    if why is not None:
        raise SystemExit(f"{why} (on CPU its Triton kernel runs in the interpreter: TRITON_INTERPRET=1)")
    return device


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="JSON-lines file the rows are appended to")
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated layer suites")
    parser.add_argument("--layers", default=None, help="comma-separated subset of the suites' layers")
    parser.add_argument("--partitioners", default=",".join(COMPARED), help="comma-separated, of " + ",".join(COMPARED))
    parser.add_argument("--t2", default=",".join(map(str, AUTO_T2)),
                        help="comma-separated t2 values (the paper: 4,8,12,16)")
    parser.add_argument("--sparsity", type=float, default=SPARSITY)
    parser.add_argument("--pattern", default=PATTERN, help="a `bench.patterns.make_weight` pattern")
    parser.add_argument("--workers", type=int, default=1, help="processes extracting blocks (each one thread)")
    parser.add_argument("--gpu", action="store_true", help="also time blocks on each partitioner's blocks and cuDNN")
    parser.add_argument("--dtypes", default=None, help="with --gpu: comma-separated of " + ",".join(TIMED_DTYPES) +
                        " (default fp32,fp16; on CPU fp32)")
    parser.add_argument("--batch", type=int, default=None, help="N (default: the suite's, 32; --smoke: 1)")
    parser.add_argument("--configs", choices=("all", "default"), default="all",
                        help="with --gpu: every blocks config at the t2 values, or one (default tile) per t2")
    add_measuring_options(parser, "timed layer")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.dtypes is None:
        on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        args.dtypes = "fp32,fp16" if on_cuda else "fp32"
    args.dtypes = tuple(args.dtypes.split(","))
    unknown = sorted(set(args.dtypes) - set(TIMED_DTYPES))
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; expected some of {', '.join(TIMED_DTYPES)}")
    return args


def _replot(args: argparse.Namespace) -> None:
    blocks = run_rows(args.out, KIND_BLOCKS, args.run)
    with open(args.out) as f:
        timed = [row for row in map(json.loads, filter(str.strip, f))
                 if row.get("kind") == KIND_TIME and row["run"] == blocks[0]["run"]]
    print(report(blocks, timed))
    if args.plot:
        plot(blocks + timed, args.plot)


def _append(path: str, rows: List[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    if args.replot:
        return _replot(args)
    partitioners = tuple(args.partitioners.split(","))
    _check_partitioners(partitioners)
    study = Study(args.sparsity, args.pattern, args.seed, partitioners, _int_list(args.t2, "t2"))
    device = _timing_device(args) if args.gpu else None
    layers = select_layers(args)
    run = new_run_id()
    print(f"run {run}: {len(layers)} layers of {args.suites}, partitioners {','.join(partitioners)}, t2 "
          f"{','.join(map(str, study.t2_values))}, {study.pattern} at sparsity {study.sparsity}"
          + (f"; timing {','.join(args.dtypes)} on {device}" if device else ""), flush=True)
    start = time.perf_counter()
    extractions = extract_all(layers, study, args.workers)
    extraction_s = time.perf_counter() - start
    cpu_base = {"run": run, **environment("cpu"), "model": None}
    blocks = []
    for layer in layers:
        label = layer_weight(layer[1], study)[1]
        blocks += [blocks_row(cpu_base, layer, label, study, extractions[(layer[0], layer[1].name, p, t2)])
                   for p in partitioners for t2 in study.t2_values]
    _append(args.out, blocks)
    print(f"extraction: {extraction_s:.1f} s wall with {args.workers} worker(s)", flush=True)
    timed = []
    if device is not None:
        timer = Timer({"run": run, **environment(device), "model": None, "mode": args.mode}, device, args.dtypes,
                      {**timing(args), "hide_launch": args.mode == "gpu" and device.type == "cuda"},
                      measure_ceilings(device), args.configs, args.seed)
        for layer in layers:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                note(f"budget of {args.budget_s:.0f} s spent: {layer[1].name} and later layers not timed")
                break
            layer_start = time.perf_counter()
            layer_rows = time_layer(layer, study, extractions, timer)
            _append(args.out, layer_rows)
            timed += layer_rows
            print(f"{layer[1].name}: timed in {time.perf_counter() - layer_start:.1f} s", flush=True)
    print(report(blocks, timed))
    print(f"{len(blocks) + len(timed)} rows appended to {args.out} in {time.perf_counter() - start:.1f} s")
    if args.plot:
        plot_or_note(plot, blocks + timed, args.plot)


if __name__ == "__main__":
    main()
