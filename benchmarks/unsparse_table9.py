"""UnSparse-Opt (paper 003) Sec. 6.2 / Table 9: the effect of the sub-batch size sbS (images per
thread block) on our `direct` backend, on the layers of suites pietron-r50-1x1, pietron-cnn1d and
pietron-vgg16 (batch 128, the paper's), against cuDNN on the same layers.

The paper runs N_B = bS * D / sbS thread blocks (Eq. 23: bS the batch, D the output channels) and
tunes sbS per layer in {2, 4, 8}. Table 9 gives the performance lost against that tuned sbS with
D * bS blocks (sbS = 1) and with D blocks (sbS = bS, the whole batch per block); see PAPER_TABLE9.
Ours: `DirectConfig.sub_batch` is sbS (images per program). For each layer, dtype and sbS the
time is that of the fastest of the backend's own candidate configs whose sub_batch is sbS
(--configs: "all" = `configs(spec, dtype)`, "auto" = the auto-tuner's, "default" = the default
config alone). Where none of them has that sub_batch (e.g. sbS = 8), the candidates are built
from all of them by `dataclasses.replace(config, sub_batch=sbS)`; the ones that cannot take it
(`DirectConfig.__post_init__` refuses, or variant "batch" whose sub_batch does not divide N) are
left out with a note, and the row says so (built, refused). The candidates differ in number per
sbS: at batch 128 "all" offers 1 config with sbS 1, 5 with 2, 3 with 4 and none with 8 (13 built),
so a large sbS is picked from more tile shapes; "default" changes sbS alone (the default tile,
like the paper's experiment, which changes nothing else). Weights: random masks at the paper's
per-layer sparsity (PAPER_SPARSITY: Tables 6-8) unless --sparsity; values as `bench layers` draws
them. cuDNN: `F.conv2d` (cudnn.benchmark on; NCHW for fp32 with TF32 off, channels_last for half)
on the same pruned weight, dense. On CPU the "cuDNN" rows are PyTorch's CPU convolution.

Usage (GPU machine; `source scripts/device-env.sh` sets PYTHONPATH; no TRITON_INTERPRET):
    python benchmarks/unsparse_table9.py OUT.jsonl [--dtypes fp32,fp16] [--sbs 1,2,4,8]
        [--suites pietron-r50-1x1,pietron-cnn1d,pietron-vgg16] [--layers l1,l2] [--batch 128]
        [--sparsity S] [--configs all|auto|default] [--plot PNG] [--budget-s S]
        [--warmup-ms 10] [--rep-ms 40] [--max-rep 100] [--mode gpu|eager] [--seed 0]
    python benchmarks/unsparse_table9.py OUT.jsonl --replot [--run ID] [--plot PNG]   (saved rows)
CPU smoke check (tiny shapes, the Triton kernels in the interpreter):
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/unsparse_table9.py OUT.jsonl --device cpu --smoke
--dtypes: comma-separated dtype names (default fp32,fp16 on CUDA, fp32 elsewhere; fp32 is TF32
off everywhere). --sbs: powers of two; above 8 only variant "batch" (up to 64) takes them.
--budget-s: start no layer after that many seconds (rows are appended per layer and dtype).
--smoke: the first layer of each suite with N=8, C and K at most 4, H and W at most 8, configs
"default" unless --configs, timing by a few calls.

Rows (JSON lines appended to OUT): every field of the results schema (`bench.schema.FIELDS`: run,
environment, suite (the layer's), layer, the shape, dtype, sparsity, pattern "random", backend
"direct" or "cudnn", config (direct: the fastest candidate's dict, its sub_batch = sbS; cudnn:
null), mode, median_ms, p20_ms, p80_ms, rel_err against fp64, floor_ms) with kind
"unsparse-table9" and: sbs (null for cudnn), config_set (--configs), candidates (direct: every
config timed at this sbS with its median_ms and rel_err), built (direct: whether the candidates
were built by replacing sub_batch), refused (direct: "config: reason" of each config left out).
One direct row per (layer, dtype, sbS) (none, with a note, where no config can take that sbS) and
one cudnn row per (layer, dtype). Candidates whose rel_err exceeds REL_ERR_LIMIT[dtype] never count
as the fastest.
Prints per layer and dtype: cuDNN ms, ms at each sbS with its speedup over sbS = 1, the best sbS;
per suite and dtype: the geomean speedup of each sbS over sbS = 1, and the loss at sbS = 1 (and at
any measured sbS outside {2, 4, 8}) against the best of sbS 2, 4, 8, beside Table 9.
--plot PNG (needs matplotlib): per suite, the speedup over sbS = 1 against sbS, one line per layer
and dtype.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
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
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.layers import free_memory, round_to
from sparsecnn.bench.patterns import make_weight
from sparsecnn.bench.roofline import floor_ms, measure_ceilings
from sparsecnn.bench.schema import DTYPES, FIELDS, torch_dtype
from sparsecnn.core.reference import reference_conv
from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers.suites import get_suite

KIND, BACKEND, PATTERN = "unsparse-table9", "direct", "random"
SUITES = ("pietron-r50-1x1", "pietron-cnn1d", "pietron-vgg16")  # smallest first: a cut run keeps the most layers
DEFAULT_SBS = "1,2,4,8"
PAPER_SBS = (2, 4, 8)  # the set the paper tunes sbS in (Sec. 6.2)
CONFIG_SETS = ("all", "auto", "default")
REL_ERR_LIMIT = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}
# Table 9 ("Impact of the usage optimal number of the thread blocks on the performance"): the
# performance decrease against the tuned sbS in {2, 4, 8} with D * bS thread blocks (sbS = 1) and
# with D blocks (sbS = bS = 128). V100-SXM2, batch 128; the paper gives no dtype or sparsity for it.
PAPER_TABLE9 = {
    "pietron-r50-1x1": {"sbS=1": 0.10, "sbS=N": 0.38},
    "pietron-vgg16": {"sbS=1": 0.10, "sbS=N": 0.45},
    "pietron-cnn1d": {"sbS=1": 0.12, "sbS=N": 0.41},
}
# Sparsity of each layer as the paper times it: Table 6 (VGG16, per layer), Table 7 (ResNet-50
# 1x1, "~90%"), Table 8 (1-D CNN at 77%, 83% and 87.5%: we take 87.5%, the nearest to the 90% of
# the other tables).
PAPER_SPARSITY = {
    "r50-1x1-64-256": 0.90, "r50-1x1-256-64": 0.90,
    "cnn1d-64x300-k2": 0.875, "cnn1d-64x300-k3": 0.875,
    "vgg-64x224-64": 0.90, "vgg-64x112-128": 0.92, "vgg-128x112-128": 0.93, "vgg-128x56-256": 0.92,
    "vgg-256x56-256": 0.908, "vgg-256x28-512": 0.92, "vgg-512x28-512": 0.92, "vgg-512x14-512": 0.92,
}
SMOKE_N, SMOKE_CHANNELS, SMOKE_HW = 8, 4, 8


def parse_sbs(text: str) -> List[int]:
    """"1,2,4,8" -> sorted distinct sub-batch sizes; ValueError unless each is a power of two >= 1."""
    values = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        value = int(part) if part.isdigit() else 0
        if value < 1 or value & (value - 1):
            raise ValueError(f"--sbs: expected comma-separated powers of two >= 1, got {part!r} in {text!r}")
        values.add(value)
    if not values:
        raise ValueError(f"--sbs: expected at least one sub-batch size, got {text!r}")
    return sorted(values)


# --- candidates ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Candidates:
    """The direct configs to time at one sbS: `configs`, each with sub_batch == sbs; `built`: whether
    they were built by replacing sub_batch in the offered configs (none offered has this sbS);
    `refused`: "config: reason" of each offered config that cannot run with this sbS."""

    sbs: int
    configs: List[Any]
    built: bool
    refused: List[str]


def offered_configs(spec: ConvSpec, dtype: str, which: str) -> List[Any]:
    """The `direct` configs the backend offers for `spec` at dtype name `dtype` (see --configs)."""
    backend, stored = get_backend(BACKEND), torch_dtype(dtype)
    if which == "default":
        return [backend.default_config(spec, stored)]
    if which == "auto":
        return backend.auto_configs(spec, stored)
    if which == "all":
        return backend.configs(spec, stored)
    raise ValueError(f"which must be one of {CONFIG_SETS}, got {which!r}")


def _launch_refusal(spec: ConvSpec, config: Any) -> Optional[str]:
    """Why the launcher would refuse `config` on `spec` though the config itself is valid (the
    check `direct_conv2d` makes at the call), or None."""
    if config.variant == "batch" and spec.N % config.sub_batch:
        return f"variant 'batch' needs sub_batch={config.sub_batch} to divide N={spec.N}"
    return None


def candidates(spec: ConvSpec, offered: Sequence[Any], sbs: int) -> Candidates:
    """The offered configs whose sub_batch is `sbs`; where there are none, every offered config with
    its sub_batch replaced by `sbs` (distinct ones). A config that cannot take `sbs` is listed in
    `refused` with the reason, never dropped silently."""
    own = [config for config in offered if config.sub_batch == sbs]
    built, refused = not own, []
    if built:
        for config in offered:
            try:
                own.append(dataclasses.replace(config, sub_batch=sbs))
            except ValueError as error:  # DirectConfig.__post_init__: sub_batch or accumulators out of range
                refused.append(f"{config}: {error}")
    configs = []
    for config in dict.fromkeys(own):
        reason = _launch_refusal(spec, config)
        if reason is None:
            configs.append(config)
        else:
            refused.append(f"{config}: {reason}")
    return Candidates(sbs, configs, built, refused)


# --- measurements ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    base: Dict[str, Any]
    device: torch.device
    seed: int
    timing: Dict[str, Any]
    ceilings: Dict[str, float]
    config_set: str


@dataclasses.dataclass
class LayerData:
    """One layer at one dtype: input x (N, C, H, W) and pruned weight (K, C, R, S), float32 with
    values rounded to the dtype; ref: the fp64 output (N, K, P, Q); sparsity: the weight's share of
    zeros asked for, density: the share of non-zeros it has."""

    spec: ConvSpec
    suite: str
    dtype: str
    sparsity: float
    x: torch.Tensor
    weight: torch.Tensor
    ref: torch.Tensor
    density: float


def layer_data(spec: ConvSpec, suite: str, dtype: str, sparsity: float, ctx: Context) -> LayerData:
    generator = torch.Generator(device=ctx.device).manual_seed(zlib.crc32(f"{ctx.seed}/{spec.name}/table9".encode()))
    x = round_to(torch.randn(spec.input_shape, generator=generator, device=ctx.device), dtype)
    weight = round_to(make_weight(spec, sparsity, PATTERN, ctx.seed, ctx.device)[0], dtype)
    ref = reference_conv(x, weight, None, stride=spec.stride, padding=spec.padding, fp64=True)
    density = weight.count_nonzero().item() / weight.numel()
    return LayerData(spec, suite, dtype, sparsity, x, weight, ref, density)


def _direct_fn(data: LayerData, config: Any):
    """The layer's call as a model makes it: packed and bound once, then called on NCHW input."""
    backend, stored = get_backend(BACKEND), torch_dtype(data.dtype)
    call = backend.bind(backend.prepare(data.weight.to(stored).contiguous(), config), data.spec, config, stored, False)
    x = data.x.to(stored).contiguous()
    return lambda: call(x, None, None, False)


def _measure(fn_maker, data: LayerData, ctx: Context, what: str) -> Optional[Dict[str, float]]:
    """`figure_script.measure_or_none` on the layer: a candidate that fails is left out (with a note),
    as the tuner drops it."""
    return measure_or_none(fn_maker, data.ref, ctx.device, data.dtype, ctx.timing,
                           f"{data.spec.name} {data.dtype}: {what}", leave_out_failures=True)


def _schema_row(data: LayerData, backend: str, config: Any, stats: Dict[str, float], ctx: Context,
                **extra) -> Dict[str, Any]:
    # cuDNN computes every weight, zeros included: its floor is the dense one
    density = data.density if backend == BACKEND else 1.0
    row = {**ctx.base, "kind": "layer", **data.spec.as_dict(), "suite": data.suite, "dtype": data.dtype,
           "sparsity": data.sparsity, "pattern": PATTERN, "backend": backend, "config": config_to_dict(config),
           **stats, "floor_ms": floor_ms(data.spec, density, data.dtype, ctx.ceilings)}
    return {**{name: row[name] for name in FIELDS}, "kind": KIND, "config_set": ctx.config_set, **extra}


def cudnn_row(data: LayerData, ctx: Context) -> Optional[Dict[str, Any]]:
    stats = _measure(lambda: cudnn_fn(data.x, data.weight, data.spec, data.dtype), data, ctx, "cuDNN")
    if stats is None:
        return None
    return _schema_row(data, "cudnn", None, stats, ctx, sbs=None, candidates=None, built=None, refused=None)


def fastest_row(data: LayerData, found: Candidates, ctx: Context) -> Optional[Dict[str, Any]]:
    """The direct row of sbS `found.sbs`: the fastest accurate candidate (None, with a note, if none)."""
    if not found.configs:
        note(f"{data.spec.name} {data.dtype} sbS={found.sbs}: no config can run it ({len(found.refused)} refused); "
             "no row")
        return None
    timed = []
    for config in found.configs:
        stats = _measure(functools.partial(_direct_fn, data, config), data, ctx, f"sbS={found.sbs} {config}")
        if stats is not None:
            timed.append((config, stats))
    limit = REL_ERR_LIMIT[data.dtype]
    accurate = [(config, stats) for config, stats in timed if stats["rel_err"] <= limit]
    if len(accurate) < len(timed):
        note(f"{data.spec.name} {data.dtype} sbS={found.sbs}: {len(timed) - len(accurate)} candidate(s) not "
             f"counted, rel_err above {limit:g}")
    if not accurate:
        note(f"{data.spec.name} {data.dtype} sbS={found.sbs}: no candidate ran accurately; no row")
        return None
    config, stats = min(accurate, key=lambda pair: pair[1]["median_ms"])
    timed_list = [dict(config=config_to_dict(c), median_ms=s["median_ms"], rel_err=s["rel_err"]) for c, s in timed]
    return _schema_row(data, BACKEND, config, stats, ctx, sbs=found.sbs, candidates=timed_list, built=found.built,
                       refused=found.refused)


def bench_layer(data: LayerData, plan: List[Candidates], ctx: Context) -> List[Dict[str, Any]]:
    """The cudnn row and one direct row per sbS of one layer at one dtype."""
    rows = [cudnn_row(data, ctx)]
    for found in plan:
        if found.built or found.refused:
            note(f"{data.spec.name} {data.dtype} sbS={found.sbs}: "
                 f"{'built by replacing sub_batch (none offered has it): ' if found.built else ''}"
                 f"{len(found.configs)} config(s), {len(found.refused)} refused")
        rows.append(fastest_row(data, found, ctx))
    return [row for row in rows if row is not None]


# --- report ----------------------------------------------------------------------------------------
def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _by_layer(rows: List[dict]) -> Dict[Tuple[str, str, str], Dict[Any, dict]]:
    """(suite, layer, dtype) -> {"cudnn": row, sbS: row} (the last row of each), in row order."""
    table: Dict[Tuple[str, str, str], Dict[Any, dict]] = {}
    for row in rows:
        key = "cudnn" if row["backend"] == "cudnn" else row["sbs"]
        table.setdefault((row["suite"], row["layer"], row["dtype"]), {})[key] = row
    return table


def losses(times: Sequence[Dict[int, float]], sbs: int) -> List[float]:
    """Per layer (times: sbS -> ms), the performance lost at `sbs` against the best of the paper's
    sbS 2, 4, 8: 1 - best_ms / ms (Table 9's "performance decrease"); layers lacking either are left out."""
    found = []
    for per_sbs in times:
        tuned = [ms for value, ms in per_sbs.items() if value in PAPER_SBS]
        if tuned and sbs in per_sbs:
            found.append(1.0 - min(tuned) / per_sbs[sbs])
    return found


def _layer_line(suite: str, layer: str, dtype: str, entry: Dict[Any, dict], sbs_values: List[int]) -> str:
    times = {sbs: entry[sbs]["median_ms"] for sbs in sbs_values if sbs in entry}
    cudnn = f"{entry['cudnn']['median_ms']:.4f}" if "cudnn" in entry else "-"
    base = times.get(1)
    cells = []
    for sbs in sbs_values:
        if sbs not in times:
            cells.append(f"{'-':>15}")
        else:
            speedup = f"{base / times[sbs]:.2f}x" if base else "-"
            cells.append(f"{times[sbs]:>8.4f} {speedup:>6}")
    best = min(times, key=times.get) if times else "-"
    sparsity = next(iter(entry.values()))["sparsity"]
    return f"{suite:16} {layer:16} {dtype:5} {sparsity:>5.3f} {cudnn:>9} {' '.join(cells)}  {best:>4}"


def _suite_lines(suite: str, dtype: str, entries: List[Dict[Any, dict]], sbs_values: List[int]) -> List[str]:
    times = [{sbs: entry[sbs]["median_ms"] for sbs in sbs_values if sbs in entry} for entry in entries]
    n = next(iter(entries[0].values()))["N"]
    lines = [f"{suite} {dtype} ({len(entries)} layers, N={n}):"]
    speedups = []
    for sbs in sbs_values:
        ratios = [t[1] / t[sbs] for t in times if 1 in t and sbs in t]
        if ratios and sbs != 1:
            speedups.append(f"sbS={sbs} {_geomean(ratios):.2f}x")
    lines.append(f"  geomean speedup over sbS=1: {', '.join(speedups) or '-'}")
    paper = PAPER_TABLE9.get(suite, {})
    for sbs in [value for value in sbs_values if value not in PAPER_SBS]:
        lost = losses(times, sbs)
        label = "sbS=1" if sbs == 1 else "sbS=N" if sbs == n else None
        against = f" (paper Table 9: {paper[label]:.0%})" if label in paper else ""
        value = (f"geomean {1 - _geomean([1 - x for x in lost]):.0%}, layers {min(lost):.0%} to {max(lost):.0%}"
                 if lost else "-")
        lines.append(f"  loss at sbS={sbs} against the best of sbS 2, 4, 8: {value}{against}")
    if n not in sbs_values and "sbS=N" in paper:
        lines.append(f"  sbS=N={n} (D thread blocks): not measured (paper Table 9: {paper['sbS=N']:.0%}); "
                     "DirectConfig takes sbS <= 8 (variant batch <= 64)")
    return lines


def report(rows: List[dict]) -> str:
    """Per layer and dtype: cuDNN ms, ms at each sbS with its speedup over sbS = 1, the best sbS;
    then per suite and dtype the geomeans and losses beside the paper's Table 9."""
    if not rows:
        return "no rows"
    first = rows[0]
    sbs_values = sorted({row["sbs"] for row in rows if row["sbs"] is not None})
    table = _by_layer(rows)
    header = " ".join(f"{f'sbS={sbs} ms (x)':>15}" for sbs in sbs_values)
    lines = [f"UnSparse-Opt Table 9 on {first['device']}, mode {first['mode']}, configs {first['config_set']} "
             f"(run {first['run']}): backend direct, fastest config per sub-batch size sbS; (x): speedup over sbS=1",
             f"{'suite':16} {'layer':16} {'dtype':5} {'spars':>5} {'cuDNN ms':>9} {header}  best"]
    lines += [_layer_line(*key, entry, sbs_values) for key, entry in table.items()]
    groups: Dict[Tuple[str, str], List[Dict[Any, dict]]] = {}
    for (suite, _, dtype), entry in table.items():
        groups.setdefault((suite, dtype), []).append(entry)
    for (suite, dtype), entries in groups.items():
        lines += _suite_lines(suite, dtype, entries, sbs_values)
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Per suite: the speedup of each sbS over sbS = 1, one line per layer and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _by_layer(rows)
    suites = list(dict.fromkeys(suite for suite, _, _ in table))
    fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        for (name, layer, dtype), entry in table.items():
            times = {sbs: row["median_ms"] for sbs, row in entry.items() if sbs != "cudnn"}
            if name != suite or 1 not in times:
                continue
            sbs_values = sorted(times)
            ax.plot(sbs_values, [times[1] / times[sbs] for sbs in sbs_values], marker="o",
                    linestyle="-" if dtype == "fp32" else "--", label=f"{layer} {dtype}")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("sub-batch size sbS (images per program)")
        ax.set_ylabel("speedup over sbS = 1")
        ax.set_title(f"{suite} ({rows[0]['device']})", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


# --- command line ----------------------------------------------------------------------------------
def _smoke_spec(spec: ConvSpec) -> ConvSpec:
    return dataclasses.replace(spec, N=SMOKE_N, C=min(spec.C, SMOKE_CHANNELS), K=min(spec.K, SMOKE_CHANNELS),
                               H=min(spec.H, SMOKE_HW), W=min(spec.W, SMOKE_HW))


def _layers(args) -> List[Tuple[str, ConvSpec]]:
    """(suite, spec) of every layer to measure, suite by suite."""
    layers = [(suite, spec) for suite in args.suites for spec in get_suite(suite, batch=args.batch)]
    if args.layers:
        wanted = args.layers.split(",")
        unknown = sorted(set(wanted) - {spec.name for _, spec in layers})
        if unknown:
            raise SystemExit(f"--layers: unknown layer(s) {', '.join(unknown)}; suites {', '.join(args.suites)} "
                             f"have {', '.join(spec.name for _, spec in layers)}")
        layers = [(suite, spec) for suite, spec in layers if spec.name in wanted]
    elif args.smoke:
        layers = [next((suite, spec) for s, spec in layers if s == suite) for suite in args.suites]
    return [(suite, _smoke_spec(spec)) for suite, spec in layers] if args.smoke else layers


def _sparsity(args, spec: ConvSpec) -> float:
    return args.sparsity if args.sparsity is not None else PAPER_SPARSITY[spec.name]


def _device_and_dtypes(args) -> Tuple[torch.device, List[str]]:
    """`figure_script.measuring_device` and args.dtypes, else fp32,fp16 on CUDA and fp32 elsewhere."""
    cuda = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    dtypes = args.dtypes or (["fp32", "fp16"] if cuda else ["fp32"])
    return measuring_device(args, dtypes), dtypes


def parse_dtypes(text: str) -> List[str]:
    """"fp32,fp16" -> distinct dtype names in order; ValueError naming --dtypes for an unknown one."""
    dtypes = list(dict.fromkeys(filter(None, (d.strip() for d in text.split(",")))))
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"--dtypes: expected comma-separated names of {', '.join(DTYPES)}, got {text!r}")
    return dtypes


def parse_suites(text: str) -> List[str]:
    """"pietron-vgg16,..." -> distinct suite names in order; ValueError naming --suites for one not in SUITES."""
    suites = list(dict.fromkeys(filter(None, (s.strip() for s in text.split(",")))))
    if not suites or any(s not in SUITES for s in suites):
        raise ValueError(f"--suites: expected comma-separated names of {', '.join(SUITES)}, got {text!r}")
    return suites


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="JSON-lines file the rows are appended to")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default fp32,fp16 on CUDA, fp32 on CPU)")
    parser.add_argument("--sbs", default=DEFAULT_SBS, help=f"sub-batch sizes (default {DEFAULT_SBS})")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated (default {','.join(SUITES)})")
    parser.add_argument("--layers", default=None, help="comma-separated subset of the suites' layers")
    parser.add_argument("--batch", type=int, default=None, help=f"N (default: the suite's, 128; --smoke: {SMOKE_N})")
    parser.add_argument("--sparsity", type=float, default=None, help="one sparsity for every layer "
                        "(default: the paper's per layer, PAPER_SPARSITY)")
    parser.add_argument("--configs", choices=CONFIG_SETS, default=None,
                        help="direct configs to pick from at each sbS (default all; --smoke: default)")
    add_measuring_options(parser, "layer")
    args = parser.parse_args(argv)
    try:
        args.dtypes = None if args.dtypes is None else parse_dtypes(args.dtypes)
        args.sbs = parse_sbs(args.sbs)
        args.suites = parse_suites(args.suites)
    except ValueError as error:
        parser.error(str(error))
    args.configs = args.configs or ("default" if args.smoke else "all")
    if args.batch is None and args.smoke:
        args.batch = SMOKE_N
    return args


def _replot(args) -> None:
    rows = run_rows(args.out, KIND, args.run)
    print(report(rows))
    if args.plot:
        plot(rows, args.plot)


def plan_layers(layers: List[Tuple[str, ConvSpec]], args) -> Dict[Tuple[str, str], List[Candidates]]:
    """(layer name, dtype) -> the candidates at each sbS."""
    return {(spec.name, dtype): [candidates(spec, offered_configs(spec, dtype, args.configs), sbs)
                                 for sbs in args.sbs]
            for _, spec in layers for dtype in args.dtypes}


def main(argv: Optional[Sequence[str]] = None) -> None:
    began = time.perf_counter()
    args = _parse(argv)
    if args.replot:
        return _replot(args)
    device, args.dtypes = _device_and_dtypes(args)
    for dtype in args.dtypes:
        why = get_backend(BACKEND).unsupported_reason(ConvSpec(1, 1, 1, 1, 1, 1, 1), torch_dtype(dtype), device.type)
        if why is not None:
            raise SystemExit(f"{why} (on CPU its Triton kernel runs in the interpreter: TRITON_INTERPRET=1)")
    layers = _layers(args)
    plan = plan_layers(layers, args)
    direct = sum(len(found.configs) for per_sbs in plan.values() for found in per_sbs)
    measured = {**timing(args), "hide_launch": args.mode == "gpu" and device.type == "cuda"}
    base = {"run": new_run_id(), **environment(device), "model": None, "mode": args.mode}
    ctx = Context(base, device, args.seed, measured, measure_ceilings(device), args.configs)
    print(f"run {base['run']}: {len(layers)} layers, dtypes {','.join(args.dtypes)}, sbS {args.sbs}, configs "
          f"{args.configs}, {device}: {direct + len(plan)} measurements ({direct} direct, {len(plan)} cuDNN)",
          flush=True)
    start, rows = time.perf_counter(), []
    for suite, spec in layers:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            note(f"budget of {args.budget_s:.0f} s spent: {spec.name} and later layers not measured")
            break
        layer_start = time.perf_counter()
        for dtype in args.dtypes:
            data = layer_data(spec, suite, dtype, _sparsity(args, spec), ctx)
            layer_rows = bench_layer(data, plan[(spec.name, dtype)], ctx)
            del data
            free_memory(device)
            with open(args.out, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in layer_rows)
            rows += layer_rows
        print(f"{suite} {spec.name}: done in {time.perf_counter() - layer_start:.1f} s", flush=True)
    print(report(rows))
    print(f"{len(rows)} rows appended to {args.out}; {time.perf_counter() - began:.1f} s in all")
    if args.plot and rows:
        plot_or_note(plot, rows, args.plot)


if __name__ == "__main__":
    main()
