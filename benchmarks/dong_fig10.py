"""Dong et al. (paper 002) Sec. 3.5 / Fig. 10 (achieved DRAM and global memory throughput per layer)
and Sec. 3.7 / Table 5 (share of warp stalls waiting for the next instruction to be fetched), measured
by Nsight Compute for our `codegen` and `unrolled` kernels against `im2col-cusparse` (the paper's
cuSPARSE baseline) and `dense` (cuDNN), on the 10 layers of the `dong` suite.

The paper (K40m, nvprof, sparsity 0.9): Fig. 10 compares its generated kernels with the cuSPARSE
convolution only, in the text as ranges (PAPER_FIG10_RATIO); Table 5 gives nvprof's stall_inst_fetch
per layer for cuDNN, cuSPARSE and its kernels (PAPER_TABLE5). Neither states the batch: the
experiments of Sec. 3.2 run N=64 (and 1), so 64 is the default here.

GPU command (repository root; ncu on PATH; about 3-4 minutes in all, see Runtime):
    source scripts/device-env.sh && python3 benchmarks/dong_fig10.py run "$OUT"
(a quick check of the pipeline: add --layers lenet-conv1 --timeout-s 120).

Modes (device-env.sh puts src on PYTHONPATH):
  run OUT_DIR [--batch 64] [--sparsity 0.9] [--pattern random] [--layers a,b] [--backends ...]
      [--ncu ncu] [--timeout-s 360] [--warm-timeout-s 200] [--no-warm] [--no-plot]
    1. `ncu --version` (recorded);
    2. warm: scripts/ncu_dong.py without ncu (codegen / unrolled compiles into the disk cache, in
       worker processes), so that the profiled process only loads kernels;
    3. profile: `ncu_command` (NVTX-filtered to the one profiled call per layer and backend, see
       scripts/ncu_dong.py; the driver starts no layer after --timeout-s minus PROFILE_MARGIN_S, so
       that ncu still writes its report), killed (its process group) after --timeout-s;
    4. export: `ncu --import REPORT --csv --page raw --print-units base` into OUT_DIR/dong_fig10.csv;
    5. parse (below). Files in OUT_DIR: dong_fig10.ncu-rep, .csv, -manifest.json (the driver's),
       -meta.json (ncu version, command lines, step times), -warm.log, -ncu.log, -export.log, then
       parse's.
  parse OUT_DIR [--no-plot]: dong_fig10.csv + the manifest (+ meta) -> OUT_DIR/dong_fig10.jsonl (rows,
    rewritten), dong_fig10.txt (the tables, also printed) and dong_fig10.svg (needs matplotlib;
    `figure_script.plot_or_note` leaves a note without it).

Metrics (METRICS; Nsight Compute 2025.x names for sm_90; NVIDIA's nvprof-to-ncu mapping in brackets):
  gpu__time_duration.sum: each kernel's duration, the weight of the per-call averages;
  dram__bytes.sum.per_second [dram_read_throughput + dram_write_throughput] and
  dram__throughput.avg.pct_of_peak_sustained_elapsed: DRAM throughput, GB/s and % of peak;
  l1tex__t_bytes_pipe_lsu_mem_global_op_ld / _st .sum.per_second [gld_throughput, gst_throughput]:
    global memory throughput = load + store (LSU global loads only: cp.async / TMA copies, which
    cuDNN's kernels may use, are not counted, so cuDNN's global figure can be low);
  smsp__warp_issue_stalled_no_instruction_per_warp_active.pct [stall_inst_fetch]: the Table 5 share,
    % of active warp cycles stalled on no_instruction;
  smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio, ..._selected_... and
    smsp__average_warp_latency_per_inst_issued.ratio: the same stall as a share of the *stalled* warp
    cycles, no_instruction / (warp cycles - selected) per issued instruction (nvprof's percentages
    are "of stalls"); both shares are in the rows.
  ncu runs with --clock-control none (as our earlier ncu runs), its default --cache-control all
  (caches flushed before each replay pass) and kernel replay.

Rows (JSON lines, kind "dong-fig10", one per layer x backend of the manifest): run, device, torch,
cudnn, triton, driver, commit, date (the driver's environment), suite, layer, N, C, K, H, W, R, S,
stride, padding, dtype, sparsity, pattern, backend, config, config_source ("auto": the backend's
first auto config; "default": its default config), status ("profiled", "skipped" with reason, or
"no kernels" when ncu recorded none), ncu_version, metrics (field -> ncu metric name), kernel_count,
duration_us (sum over the call's kernels), dram_gbps, dram_pct_of_peak, global_gbps (load + store),
global_load_gbps, global_store_gbps, no_instruction_pct_of_warp_cycles,
no_instruction_pct_of_stall_cycles: duration-weighted means over the call's kernels (a rate so
averaged is the call's bytes over its kernel time); kernels: per kernel id, name, grid, block and
the same fields. A call is all of a backend's kernels: im2col-cusparse's unfold and copies,
unrolled's input packing (the input is NCHW), codegen's slices, cuDNN's transforms.

Runtime (estimated, not measured: no GPU where this was written): ~100 profiled kernels (codegen 1-4
slices, unrolled pack + conv, im2col-cusparse ~5, cuDNN 1-3, per layer), each replayed once per
metric pass (~4-6 passes for this list) at ~0.3-0.6 s of ncu overhead per kernel, plus ~30 s of
process and CUDA start under ncu and the unprofiled warm-up calls: 90-150 s for the profile step on
an H100; the warm step ~60-120 s (cold compiles, parallel), export and parse a few seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from figure_script import plot_or_note

from sparsecnn.layers import get_suite

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "scripts" / "ncu_dong.py"
KIND = "dong-fig10"
STEM = "dong_fig10"
# The driver starts no layer later than this before the timeout (its clock starts after its imports and
# CUDA start, ~30 s under ncu): the last layer's calls and ncu's report must fit in the rest.
PROFILE_MARGIN_S = 90.0
TERMINATE_GRACE_S = 10.0


def _load_driver():
    """scripts/ncu_dong.py as a module: its range names and backend list are the ones profiled."""
    spec = importlib.util.spec_from_file_location("ncu_dong", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ncu_dong = _load_driver()


@dataclasses.dataclass(frozen=True)
class Metric:
    """field: the kernel record's key; name: the ncu metric; kind: "time" (to microseconds), "rate"
    (bytes per second, to GB/s), "pct" (%) or "ratio" (cycles per issued instruction; unit ignored)."""

    field: str
    name: str
    kind: str


METRICS: Tuple[Metric, ...] = (
    Metric("duration_us", "gpu__time_duration.sum", "time"),
    Metric("dram_gbps", "dram__bytes.sum.per_second", "rate"),
    Metric("dram_pct_of_peak", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "pct"),
    Metric("global_load_gbps", "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum.per_second", "rate"),
    Metric("global_store_gbps", "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second", "rate"),
    Metric("no_instruction_pct_of_warp_cycles", "smsp__warp_issue_stalled_no_instruction_per_warp_active.pct", "pct"),
    Metric("no_instruction_per_issue", "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio",
           "ratio"),
    Metric("selected_per_issue", "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "ratio"),
    Metric("warp_cycles_per_issue", "smsp__average_warp_latency_per_inst_issued.ratio", "ratio"),
)
# the per-kernel quantities averaged over a call's kernels, weighted by their durations
AVERAGED = ("dram_gbps", "dram_pct_of_peak", "global_gbps", "global_load_gbps", "global_store_gbps",
            "no_instruction_pct_of_warp_cycles", "no_instruction_pct_of_stall_cycles")

# Paper 002 Sec. 3.5, Fig. 10 (its text; the bars themselves are not in our copy): the generated kernels'
# DRAM throughput is 1.4-14x the cuSPARSE convolution's, their global memory throughput 1.1-3.2x.
PAPER_FIG10_RATIO = {"dram": (1.4, 14.0), "global": (1.1, 3.2)}
# Paper 002 Sec. 3.7, Table 5: % of stalls caused by instruction fetch (nvprof stall_inst_fetch), sparsity 0.9.
PAPER_TABLE5 = {
    "cuDNN": {"alexnet-conv1": 4.89, "alexnet-conv2": 5.02, "alexnet-conv3": 6.81, "lenet-conv1": 6.30,
              "lenet-conv2": 4.77, "resnet-conv1": 3.95, "resnet-conv2": 4.86, "vgg-conv1": 4.91,
              "vgg-conv2": 3.60, "vgg-conv3": 3.28},
    "cuSPARSE": {"alexnet-conv1": 5.03, "alexnet-conv2": 5.96, "alexnet-conv3": 6.58, "lenet-conv1": 6.41,
                 "lenet-conv2": 5.11, "resnet-conv1": 4.03, "resnet-conv2": 4.08, "vgg-conv1": 9.87,
                 "vgg-conv2": 4.23, "vgg-conv3": 3.74},
    "Our": {"alexnet-conv1": 1.64, "alexnet-conv2": 2.12, "alexnet-conv3": 3.24, "lenet-conv1": 2.67,
            "lenet-conv2": 4.31, "resnet-conv1": 2.83, "resnet-conv2": 3.50, "vgg-conv1": 1.49,
            "vgg-conv2": 2.27, "vgg-conv3": 2.70},
}
PAPER_METHOD = {"codegen": "Our", "im2col-cusparse": "cuSPARSE", "dense": "cuDNN"}  # our backend -> paper's column
CUSPARSE = "im2col-cusparse"
OURS = ("codegen", "unrolled")


# the files of one run in its output directory: STEM + suffix
SUFFIXES = {"report": ".ncu-rep", "csv": ".csv", "manifest": "-manifest.json", "meta": "-meta.json",
            "warm_log": "-warm.log", "ncu_log": "-ncu.log", "export_log": "-export.log", "rows": ".jsonl",
            "table": ".txt", "svg": ".svg"}


@dataclasses.dataclass(frozen=True)
class Paths:
    """The files of one run (SUFFIXES) in `out_dir`."""

    out_dir: Path
    report: Path
    csv: Path
    manifest: Path
    meta: Path
    warm_log: Path
    ncu_log: Path
    export_log: Path
    rows: Path
    table: Path
    svg: Path

    @classmethod
    def in_dir(cls, out_dir: Path) -> "Paths":
        return cls(out_dir, **{name: out_dir / f"{STEM}{suffix}" for name, suffix in SUFFIXES.items()})


# --- command lines ---------------------------------------------------------------------------------
def driver_argv(args: argparse.Namespace, manifest: Path, budget_s: Optional[float], prefetch: bool) -> List[str]:
    """`python scripts/ncu_dong.py ...` for this run's layers and backends."""
    argv = [sys.executable, str(DRIVER), "--batch", str(args.batch), "--sparsity", str(args.sparsity),
            "--pattern", args.pattern, "--backends", args.backends, "--manifest", str(manifest)]
    if args.layers:
        argv += ["--layers", args.layers]
    if budget_s is not None:
        argv += ["--budget-s", f"{budget_s:.0f}"]
    return argv + ([] if prefetch else ["--no-prefetch"])


def ncu_command(ncu: str, report: Path, target: Sequence[str]) -> List[str]:
    """ncu profiling every kernel inside the driver's PROFILED_RANGE push/pop range (one call per layer
    and backend) with METRICS only, into `report` (.ncu-rep)."""
    return [ncu, "--metrics", ",".join(metric.name for metric in METRICS),
            "--nvtx", "--nvtx-include", f"{ncu_dong.PROFILED_RANGE}/",
            "--clock-control", "none", "--target-processes", "all",
            "--force-overwrite", "--export", str(report), *target]


def export_command(ncu: str, report: Path) -> List[str]:
    """ncu printing `report`'s raw page as CSV (a header row of names, a row of units, a row per kernel),
    units unscaled."""
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]


def ncu_version(text: str) -> str:
    """The version in `ncu --version`'s output ("... Version 2025.3.1.0 (build ...)" -> "2025.3.1.0"),
    else its last non-empty line."""
    found = re.search(r"Version\s+(\S+)", text)
    if found:
        return found.group(1)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown"


def run_logged(argv: Sequence[str], log: Path, timeout_s: float, stdout: Optional[Path] = None) -> Dict[str, Any]:
    """Run `argv` in its own process group, stderr (and stdout unless `stdout`) to `log`; on timeout
    terminate the group (then kill it). Returns {"command", "rc", "wall_s", "timed_out"}."""
    start = time.perf_counter()
    with open(log, "w") as log_file, (open(stdout, "w") if stdout else contextlib.nullcontext(log_file)) as out_file:
        process = subprocess.Popen(list(argv), stdout=out_file, stderr=log_file, start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return {"command": shlex.join(argv), "rc": process.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "timed_out": timed_out}


# --- the raw CSV -----------------------------------------------------------------------------------
NVTX_COLUMN_PREFIX = "thread Domain:Push/Pop_Range"
DEFAULT_DOMAIN = "<default domain>"
_TIME_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
               "second": 1e6, "s": 1e6}
_DECIMAL_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}  # ncu's byte prefixes are decimal


def read_raw_csv(text: str) -> Tuple[List[Dict[str, str]], Dict[str, str]]:
    """(one dict per kernel launch, column -> unit) of `ncu --csv --page raw`: a header row of column
    names, a row of units, then a row per launch. Lines before the header (ncu's "==PROF==" messages
    in a log) are skipped."""
    lines = text.splitlines()
    start = next((index for index, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a line starting with \"ID\") in the text")
    table = [row for row in csv.reader(io.StringIO("\n".join(lines[start:]))) if row]
    if len(table) < 2:
        raise ValueError("ncu raw CSV needs a header row and a units row")
    header, units = table[0], table[1]
    return [dict(zip(header, row)) for row in table[2:]], dict(zip(header, units))


def number(text: Optional[str], column: str) -> Optional[float]:
    """A CSV cell as a float (thousands separators dropped); None for an empty or "n/a" cell."""
    cell = (text or "").strip().replace(",", "")
    if cell.lower() in ("", "n/a"):
        return None
    try:
        return float(cell)
    except ValueError:
        raise ValueError(f"column {column}: expected a number, got {text!r}") from None


def scaled(value: Optional[float], unit: str, metric: Metric) -> Optional[float]:
    """`value` in `unit` converted to the metric's field unit: us, GB/s, % or the ratio as is."""
    if value is None or metric.kind == "ratio":
        return value
    unit = unit.strip()
    if metric.kind == "time" and unit in _TIME_TO_US:
        return value * _TIME_TO_US[unit]
    rate = re.fullmatch(r"([KMGT]?)byte/s(?:econd)?", unit)
    if metric.kind == "rate" and rate:
        return value * _DECIMAL_PREFIX[rate.group(1)] / 1e9
    if metric.kind == "pct" and unit == "%":
        return value
    raise ValueError(f"{metric.name}: unexpected unit {unit!r} for a {metric.kind} metric")


def nvtx_column(header: Sequence[str]) -> str:
    """The raw page's push/pop range column ("thread Domain:Push/Pop_Range:PL_Type:...:Msg" in
    Nsight Compute 2025; a shorter name in other versions)."""
    for column in header:
        if column.startswith(NVTX_COLUMN_PREFIX):
            return column
    raise ValueError(f"no {NVTX_COLUMN_PREFIX!r} column in the CSV: profile with --nvtx")


def push_pop_ranges(cell: str, column: str) -> List[str]:
    """Names of the default domain's push/pop ranges in one NVTX cell, outermost first.

    A cell reads `<thread id>  "<domain>:<range>:<field>:...:<field>"  "..."`: one quoted entry per range
    on the launching thread's stack, with as many fields after the range name as `column` names
    after "Push/Pop_Range" (PL_Type ... Msg)."""
    fields_after = len(column.split(":")) - 2
    names = []
    for entry in re.findall(r'"([^"]*)"', cell):
        fields = entry.split(":")
        if len(fields) < 2 + fields_after:
            raise ValueError(f"NVTX entry {entry!r} has fewer fields than column {column!r} names")
        if fields[0] == DEFAULT_DOMAIN:
            names.append(":".join(fields[1:len(fields) - fields_after]))
    return names


def call_range(ranges: Sequence[str], kernel: str) -> str:
    """The "<layer>/<backend>" range pushed inside the driver's PROFILED_RANGE around `kernel`."""
    marker = ncu_dong.PROFILED_RANGE
    if marker not in ranges:
        raise ValueError(f"kernel {kernel} is outside the {marker!r} range (its ranges: {list(ranges)})")
    inner = ranges[ranges.index(marker) + 1:]
    if not inner:
        raise ValueError(f"kernel {kernel} has no range inside {marker!r}")
    ncu_dong.split_range_name(inner[0])
    return inner[0]


def no_instruction_share_of_stalls(no_instruction: Optional[float], selected: Optional[float],
                                   warp_cycles: Optional[float]) -> Optional[float]:
    """% of the stalled warp cycles spent waiting for an instruction fetch: per issued instruction, the
    no_instruction cycles over all warp cycles but the issuing (`selected`) one. None where a term is
    missing or no cycle stalled."""
    if no_instruction is None or selected is None or warp_cycles is None or warp_cycles <= selected:
        return None
    return 100.0 * no_instruction / (warp_cycles - selected)


def kernel_record(raw: Dict[str, str], units: Dict[str, str], column: str) -> Dict[str, Any]:
    """One profiled launch: id, name, grid, block, range ("<layer>/<backend>"), each METRICS field in
    its unit, global_gbps (load + store) and no_instruction_pct_of_stall_cycles."""
    name = raw.get("Kernel Name", "")
    record: Dict[str, Any] = {"id": int(raw["ID"]), "name": name, "grid": raw.get("Grid Size"),
                              "block": raw.get("Block Size"),
                              "range": call_range(push_pop_ranges(raw.get(column, ""), column), name)}
    for metric in METRICS:
        if metric.name not in raw:
            raise ValueError(f"metric {metric.name} missing from the CSV (profiled with another metric list?)")
        record[metric.field] = scaled(number(raw[metric.name], metric.name), units.get(metric.name, ""), metric)
    if record["duration_us"] is None:
        raise ValueError(f"kernel {record['id']} ({name}) has no {METRICS[0].name}: cannot weight it")
    load, store = record["global_load_gbps"], record["global_store_gbps"]
    record["global_gbps"] = None if load is None or store is None else load + store
    record["no_instruction_pct_of_stall_cycles"] = no_instruction_share_of_stalls(
        record["no_instruction_per_issue"], record["selected_per_issue"], record["warp_cycles_per_issue"])
    return record


def kernels_by_range(text: str) -> Dict[str, List[Dict[str, Any]]]:
    """The raw CSV's kernel records grouped by their "<layer>/<backend>" range, in launch order."""
    raws, units = read_raw_csv(text)
    grouped: Dict[str, List[Dict[str, Any]]] = {}
    if not raws:
        return grouped
    column = nvtx_column(list(raws[0]))
    for raw in raws:
        record = kernel_record(raw, units, column)
        grouped.setdefault(record["range"], []).append(record)
    return grouped


# --- aggregation and rows --------------------------------------------------------------------------
def weighted_mean(values: Sequence[Optional[float]], weights: Sequence[float]) -> Optional[float]:
    """sum(v * w) / sum(w) over the values that are not None; None when none is."""
    pairs = [(value, weight) for value, weight in zip(values, weights) if value is not None]
    total = sum(weight for _, weight in pairs)
    return sum(value * weight for value, weight in pairs) / total if pairs and total > 0 else None


def aggregate(kernels: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One call from its kernels: kernel_count, duration_us (their sum) and every AVERAGED field as the
    duration-weighted mean (for a rate: the call's bytes over its kernel time)."""
    durations = [kernel["duration_us"] for kernel in kernels]
    summary: Dict[str, Any] = {"kernel_count": len(kernels), "duration_us": sum(durations)}
    for field in AVERAGED:
        summary[field] = weighted_mean([kernel[field] for kernel in kernels], durations)
    return summary


def _empty_summary() -> Dict[str, Any]:
    return {"kernel_count": 0, "duration_us": None, **{field: None for field in AVERAGED}}


def build_rows(manifest: Dict[str, Any], grouped: Dict[str, List[Dict[str, Any]]],
               version: Optional[str]) -> List[Dict[str, Any]]:
    """One row per manifest entry (layer x backend; see the module docstring), in the driver's order."""
    known = {entry["range"] for entry in manifest["entries"]}
    strangers = sorted(set(grouped) - known)
    if strangers:
        raise ValueError(f"kernels of ranges the manifest does not list: {', '.join(strangers)}")
    specs = {spec.name: spec for spec in get_suite(manifest["suite"], batch=manifest["batch"])}
    rows = []
    for entry in manifest["entries"]:
        kernels = grouped.get(entry["range"], [])
        status = entry["status"] if kernels or entry["status"] != "profiled" else "no kernels"
        rows.append({
            "run": manifest["run"], "kind": KIND, **manifest["environment"], "suite": manifest["suite"],
            **specs[entry["layer"]].as_dict(), "dtype": manifest["dtype"], "sparsity": manifest["sparsity"],
            "pattern": entry["pattern"], "backend": entry["backend"], "config": entry["config"],
            "config_source": entry["config_source"], "status": status, "reason": entry["reason"],
            "ncu_version": version, "metrics": {metric.field: metric.name for metric in METRICS},
            **(aggregate(kernels) if kernels else _empty_summary()), "kernels": kernels,
        })
    return rows


# --- tables ----------------------------------------------------------------------------------------
def _format_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width)
                      in enumerate(zip(row, widths))) for row in [header, *body]]


def _by_layer(rows: Sequence[Dict[str, Any]]) -> Tuple[List[str], List[str], Dict[Tuple[str, str], Dict]]:
    """(layers in order, backends in order, (layer, backend) -> row)."""
    layers = list(dict.fromkeys(row["layer"] for row in rows))
    backends = list(dict.fromkeys(row["backend"] for row in rows))
    return layers, backends, {(row["layer"], row["backend"]): row for row in rows}


def _value(row: Optional[Dict[str, Any]], field: str) -> Optional[float]:
    return None if row is None or row["status"] != "profiled" else row[field]


def _cell(row: Optional[Dict[str, Any]], field: str, digits: int) -> str:
    if row is None:
        return "-"
    if row["status"] != "profiled":
        return row["status"]
    value = row[field]
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator is not None and denominator else None


def _ratio_cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _range_text(values: Sequence[float]) -> str:
    if not values:
        return "no layer"
    return f"{min(values):.2f}-{max(values):.2f}x over {len(values)} layer{'' if len(values) == 1 else 's'}"


def fig10_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Per layer and backend: DRAM GB/s (% of peak) and global GB/s, with ours over cuSPARSE's; then
    the range of those ratios beside the paper's."""
    layers, backends, table = _by_layer(rows)
    ours = [name for name in OURS if name in backends]
    lines = []
    ratios: Dict[Tuple[str, str], List[float]] = {}
    for what, field in (("dram", "dram_gbps"), ("global", "global_gbps")):
        header = ["layer", *[f"{name} GB/s" for name in backends], *[f"{name}/cuSPARSE" for name in ours]]
        body = []
        for layer in layers:
            cells = []
            for name in backends:
                row = table.get((layer, name))
                cell = _cell(row, field, 1)
                pct = _value(row, "dram_pct_of_peak") if what == "dram" else None
                cells.append(cell if pct is None else f"{cell} ({pct:.0f}%)")
            for name in ours:
                ratio = _ratio(_value(table.get((layer, name)), field), _value(table.get((layer, CUSPARSE)), field))
                if ratio is not None:
                    ratios.setdefault((what, name), []).append(ratio)
                cells.append(_ratio_cell(ratio))
            body.append([layer, *cells])
        title = ("DRAM throughput, GB/s (% of peak): dram__bytes.sum.per_second" if what == "dram" else
                 "global memory throughput, GB/s: l1tex__t_bytes_pipe_lsu_mem_global_op_{ld,st}.sum.per_second")
        lines += [title, *_format_table(header, body), ""]
    for what in ("dram", "global"):
        low, high = PAPER_FIG10_RATIO[what]
        for name in ours:
            lines.append(f"{what} throughput {name} / cuSPARSE: {_range_text(ratios.get((what, name), []))} "
                         f"(paper, generated code / cuSPARSE: {low:g}-{high:g}x)")
    return lines


def table5(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Per layer and backend: the no_instruction share of active warp cycles, the paper's Table 5
    beside it, and each column's mean over the layers shown."""
    layers, backends, table = _by_layer(rows)
    paper_columns = [PAPER_METHOD[name] for name in backends if name in PAPER_METHOD]
    header = ["layer", *backends, *[f"paper {column}" for column in paper_columns]]
    field = "no_instruction_pct_of_warp_cycles"
    body = []
    for layer in layers:
        ours = [_cell(table.get((layer, name)), field, 2) for name in backends]
        paper = [f"{PAPER_TABLE5[column][layer]:.2f}" if layer in PAPER_TABLE5[column] else "-"
                 for column in paper_columns]
        body.append([layer, *ours, *paper])
    means = []
    for name in backends:
        values = [v for v in (_value(table.get((layer, name)), field) for layer in layers) if v is not None]
        means.append(f"{statistics.mean(values):.2f}" if values else "-")
    for column in paper_columns:
        values = [PAPER_TABLE5[column][layer] for layer in layers if layer in PAPER_TABLE5[column]]
        means.append(f"{statistics.mean(values):.2f}" if values else "-")
    body.append(["mean", *means])
    title = ("no_instruction stall, % of active warp cycles: smsp__warp_issue_stalled_no_instruction_per_warp_active"
             ".pct (paper: nvprof stall_inst_fetch, % of stalls; rows also hold the share of stalled cycles)")
    return [title, *_format_table(header, body)]


def report(rows: Sequence[Dict[str, Any]]) -> str:
    """Fig. 10's and Table 5's tables, and the skipped backends with their reasons."""
    if not rows:
        return "no rows"
    first = rows[0]
    title = (f"Dong Fig. 10 / Table 5 on {first['device']}, N={first['N']}, {first['dtype']}, sparsity "
             f"{first['sparsity']:g}, ncu {first['ncu_version']} (run {first['run']})")
    lines = [title, "", *fig10_table(rows), "", *table5(rows)]
    notes = [f"  {row['layer']}/{row['backend']}: {row['status']}{': ' + row['reason'] if row['reason'] else ''}"
             for row in rows if row["status"] != "profiled"]
    return "\n".join(lines + (["", "not measured:", *notes] if notes else []))


def plot(rows: Sequence[Dict[str, Any]], path: str) -> None:
    """Grouped bars per layer like Fig. 10: DRAM and global memory throughput (GB/s, log scale), one bar
    per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, backends, table = _by_layer(rows)
    width = 0.8 / len(backends)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.1 * len(layers)), 7.5), sharex=True)
    for ax, (field, label) in zip(axes, (("dram_gbps", "DRAM throughput, GB/s"),
                                         ("global_gbps", "global memory throughput, GB/s"))):
        for index, name in enumerate(backends):
            points = [(position, _value(table.get((layer, name)), field)) for position, layer in enumerate(layers)]
            points = [(position + (index - (len(backends) - 1) / 2) * width, value)
                      for position, value in points if value]
            ax.bar([x for x, _ in points], [y for _, y in points], width, label=name)
        ax.set_yscale("log")
        ax.set_ylabel(label)
    axes[-1].set_xticks(range(len(layers)), layers, rotation=30, ha="right")
    # above the bars, under the title: the bars reach the top of either panel
    axes[0].legend(fontsize=8, ncol=len(backends), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    first = rows[0]
    fig.suptitle(f"Dong Fig. 10: memory throughput, N={first['N']} {first['dtype']} sparsity "
                 f"{first['sparsity']:g} ({first['device']}, ncu {first['ncu_version']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot written to {path}")


# --- modes -----------------------------------------------------------------------------------------
def parse_outputs(paths: Paths, plot_path: Optional[Path]) -> List[Dict[str, Any]]:
    """CSV + manifest (+ meta) of `paths` -> rows file, table file (printed) and the plot."""
    for path in (paths.csv, paths.manifest):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run `dong_fig10.py run` first (or copy its outputs there)")
    manifest = json.loads(paths.manifest.read_text())
    meta = json.loads(paths.meta.read_text()) if paths.meta.is_file() else {}
    rows = build_rows(manifest, kernels_by_range(paths.csv.read_text()), meta.get("ncu_version"))
    if manifest["not_started"]:
        print(f"not started (the driver's budget ran out): {', '.join(manifest['not_started'])}")
    paths.rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report(rows)
    paths.table.write_text(text + "\n")
    print(text)
    print(f"{len(rows)} rows written to {paths.rows}")
    if plot_path is not None and any(row["status"] == "profiled" for row in rows):
        plot_or_note(plot, rows, str(plot_path))
    return rows


def run(args: argparse.Namespace, paths: Paths) -> None:
    """ncu version, warm run, profile, export (module docstring), then parse."""
    meta: Dict[str, Any] = {"metrics": [metric.name for metric in METRICS], "steps": {}}
    version = subprocess.run([args.ncu, "--version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        raise SystemExit(f"`{args.ncu} --version` failed: {version.stderr.strip()}")
    meta.update(ncu_version=ncu_version(version.stdout), ncu_version_text=version.stdout.strip())
    if not args.no_warm:
        meta["steps"]["warm"] = run_logged(driver_argv(args, paths.manifest, None, prefetch=True), paths.warm_log,
                                           args.warm_timeout_s)
        print(f"warm: {meta['steps']['warm']}", flush=True)
    budget_s = max(args.timeout_s - PROFILE_MARGIN_S, 0.0)
    profile = ncu_command(args.ncu, paths.report, driver_argv(args, paths.manifest, budget_s, prefetch=False))
    meta["steps"]["profile"] = run_logged(profile, paths.ncu_log, args.timeout_s)
    print(f"profile: {meta['steps']['profile']}", flush=True)
    paths.meta.write_text(json.dumps(meta, indent=1))
    if not paths.report.is_file():
        raise SystemExit(f"ncu wrote no report {paths.report}; see {paths.ncu_log}")
    meta["steps"]["export"] = run_logged(export_command(args.ncu, paths.report), paths.export_log, 120,
                                         stdout=paths.csv)
    paths.meta.write_text(json.dumps(meta, indent=1))
    if meta["steps"]["export"]["rc"] != 0:
        raise SystemExit(f"export failed: {meta['steps']['export']}; see {paths.export_log}")
    parse_outputs(paths, None if args.no_plot else paths.svg)


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("run", "parse"))
    parser.add_argument("out_dir", type=Path, help="directory of the run's files")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--pattern", default="random")
    parser.add_argument("--layers", default=None, help="comma-separated subset of the dong suite")
    parser.add_argument("--backends", default=",".join(ncu_dong.BACKENDS))
    parser.add_argument("--ncu", default="ncu", help="the ncu executable")
    parser.add_argument("--timeout-s", type=float, default=360.0, help="the profile step's limit")
    parser.add_argument("--warm-timeout-s", type=float, default=200.0, help="the warm step's limit")
    parser.add_argument("--no-warm", action="store_true", help="profile with whatever the compile cache holds")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.timeout_s <= PROFILE_MARGIN_S:
        parser.error(f"--timeout-s must exceed {PROFILE_MARGIN_S:.0f} s (the driver's margin), got {args.timeout_s:g}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse_args(argv)
    paths = Paths.in_dir(args.out_dir)
    if args.mode == "parse":
        parse_outputs(paths, None if args.no_plot else paths.svg)
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run(args, paths)


if __name__ == "__main__":
    main()
