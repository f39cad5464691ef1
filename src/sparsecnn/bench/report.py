"""Markdown tables and plots of results rows (see `schema`).

Layer rows are grouped by (device, suite, N, dtype, sparsity, pattern); the cuDNN baselines of the same
(device, suite, N, sparsity, pattern) are shown beside every dtype group. A backend's speedup is
cuDNN's median time at the group's dtype over the backend's; with several configs of one backend
(`configs` "auto" or "all") the fastest is shown. Model rows are compared with the dense model's
rows. Where rows repeat a measurement, the last one counts. Plots need matplotlib (the `plot` extra),
imported only when a plot is drawn.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from sparsecnn.bench.layers import CUDNN
from sparsecnn.bench.peers import PEER_PREFIX
from sparsecnn.bench.schema import DTYPES
from sparsecnn.core.device import cuda_core_fma_rate, nominal_for_name
from sparsecnn.core.spec import ConvSpec

Row = Dict[str, Any]
_BASE_KEY = ("device", "suite", "N", "sparsity", "pattern")
_MODEL_KEY = ("device", "model", "N", "dtype", "sparsity", "pattern")


@dataclasses.dataclass
class _LayerGroup:
    """One table: the layers of one (device, suite, N, dtype, sparsity, pattern)."""

    device: str
    suite: Optional[str]
    N: int
    dtype: Optional[str]  # None: a group with cuDNN rows only
    sparsity: float
    pattern: str
    layers: List[str] = dataclasses.field(default_factory=list)
    backends: List[str] = dataclasses.field(default_factory=list)
    cudnn: Dict[Tuple[str, str], Row] = dataclasses.field(default_factory=dict)  # (layer, dtype) -> row
    best: Dict[Tuple[str, str], Row] = dataclasses.field(default_factory=dict)  # (layer, backend) -> row

    @property
    def title(self) -> str:
        dtype = self.dtype or "cuDNN only"
        return (f"{self.suite} · N={self.N} · {dtype} · sparsity {self.sparsity:g} · {self.pattern} · "
                f"{self.device}")

    def speedup(self, layer: str, backend: str) -> Optional[float]:
        """cuDNN ms at the group's dtype / backend ms, None without either."""
        base, row = self.cudnn.get((layer, self.dtype)), self.best.get((layer, backend))
        if base is None or row is None or row["median_ms"] <= 0:
            return None
        return base["median_ms"] / row["median_ms"]


def _add(ordered: List[str], item: str) -> None:
    if item not in ordered:
        ordered.append(item)


def _layer_groups(rows: Iterable[Row]) -> List[_LayerGroup]:
    """The layer tables of `rows`. A group lists, in order of first appearance, the layers with a
    backend row at its dtype or a cuDNN row at its dtype; a (device, suite, N, sparsity, pattern) with
    cuDNN rows only becomes one group of dtype None."""
    layer_rows = [row for row in rows if row["kind"] == "layer"]
    baselines: Dict[tuple, Dict[Tuple[str, str], Row]] = {}
    for row in layer_rows:
        if row["backend"] == CUDNN:
            baselines.setdefault(_base_key(row), {})[(row["layer"], row["dtype"])] = row
    groups: Dict[tuple, _LayerGroup] = {}
    for row in layer_rows:
        if row["backend"] != CUDNN:
            base = _base_key(row)
            group = groups.setdefault(base + (row["dtype"],), _new_group(base, row["dtype"], baselines))
            _add(group.backends, row["backend"])
            best = group.best.get((row["layer"], row["backend"]))
            if best is None or row["median_ms"] <= best["median_ms"]:
                group.best[(row["layer"], row["backend"])] = row
    for base in baselines:
        if not any(key[:-1] == base for key in groups):
            groups[base + (None,)] = _new_group(base, None, baselines)
    for row in layer_rows:
        group = groups.get(_base_key(row) + (row["dtype"],))
        if group is not None:
            _add(group.layers, row["layer"])
        elif row["backend"] == CUDNN and _base_key(row) + (None,) in groups:
            _add(groups[_base_key(row) + (None,)].layers, row["layer"])
    return list(groups.values())


def _base_key(row: Row) -> tuple:
    return tuple(row[name] for name in _BASE_KEY)


def _new_group(base: tuple, dtype: Optional[str], baselines) -> _LayerGroup:
    return _LayerGroup(**dict(zip(_BASE_KEY, base)), dtype=dtype, cudnn=baselines.get(base, {}))


def geomean(values: Iterable[float]) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _ms(row: Optional[Row]) -> str:
    return "—" if row is None else f"{row['median_ms']:.4g}"


def _times(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _table(header: List[str], body: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def efficiency(row: Row) -> Optional[float]:
    """Fraction of the GPU's CUDA-core multiply-add rate a layer row's non-zero work ran at: non-zero
    MACs (N P Q K C R S / groups x (1 - sparsity)) / (median time x `cuda_core_fma_rate` of the row's
    GPU, by its name, for fp32 or packed fp16/bf16). None off CUDA or for an unknown GPU."""
    props = nominal_for_name(row.get("device") or "")
    rate = None if props is None else cuda_core_fma_rate(props, row["dtype"] in ("fp16", "bf16"))
    if rate is None or not row.get("median_ms") or row.get("kind") != "layer":
        return None
    pair = lambda value: tuple(value) if isinstance(value, (list, tuple)) else value  # noqa: E731
    spec = ConvSpec(row["N"], row["C"], row["K"], row["H"], row["W"], row["R"], row["S"], pair(row["stride"]),
                    pair(row["padding"]))
    macs = spec.N * spec.P * spec.Q * spec.K * spec.C * spec.R * spec.S / spec.groups * (1 - row["sparsity"])
    return macs / (row["median_ms"] * 1e-3 * rate)


def _baseline_dtypes(group: _LayerGroup) -> List[str]:
    present = {dtype for _, dtype in group.cudnn}
    return [dtype for dtype in DTYPES if dtype in present]


def _layer_cells(group: _LayerGroup, layer: str, cudnn_dtypes: List[str]) -> List[str]:
    cells = [layer] + [_ms(group.cudnn.get((layer, dtype))) for dtype in cudnn_dtypes]
    runs = [group.best[(layer, b)] for b in group.backends if (layer, b) in group.best]
    for backend in group.backends:
        cells += [_ms(group.best.get((layer, backend))), _times(group.speedup(layer, backend))]
    errors = [row["rel_err"] for row in runs if row["rel_err"] is not None]
    fastest = min(runs, key=lambda row: row["median_ms"], default=None)
    floor = None if fastest is None else fastest["floor_ms"]
    cells.append(f"{max(errors):.1e}" if errors else "—")
    cells.append("—" if floor is None else f"{floor:.4g}")
    share = None if floor is None or fastest["median_ms"] <= 0 else 100 * floor / fastest["median_ms"]
    cells.append("—" if share is None else f"{share:.3g}%")
    # "sparse eff %" is about our backends: peers' rows ("peer:...") are shown but not counted there
    sparse = [row for row in runs if row["backend"] != CUDNN and not row["backend"].startswith(("dense", PEER_PREFIX))]
    best_sparse = min(sparse, key=lambda row: row["median_ms"], default=None)
    used = None if best_sparse is None else efficiency(best_sparse)
    cells.append("—" if used is None else f"{100 * used:.3g}%")
    return cells


def _group_markdown(group: _LayerGroup) -> str:
    cudnn_dtypes = _baseline_dtypes(group)
    header = ["layer"] + [f"cuDNN {dtype} ms" for dtype in cudnn_dtypes]
    for backend in group.backends:
        header += [f"{backend} ms", f"{backend} ×"]
    header += ["max rel_err", "floor ms", "floor %", "sparse eff %"]
    body = [_layer_cells(group, layer, cudnn_dtypes) for layer in group.layers]
    parts = [f"### {group.title}", "", _table(header, body), ""]
    if group.backends:
        means = [f"{b} {_times(geomean(group.speedup(layer, b) for layer in group.layers))}"
                 for b in group.backends]
        parts.append(f"Geomean speedup vs cuDNN {group.dtype}: " + ", ".join(means) + ".")
        parts.append("")
    return "\n".join(parts)


def _model_groups(rows: Iterable[Row]) -> Dict[tuple, Dict[Tuple[str, str], Row]]:
    """(device, model, N, dtype, sparsity, pattern) -> {(backend, mode): last row}."""
    groups: Dict[tuple, Dict[Tuple[str, str], Row]] = {}
    for row in rows:
        if row["kind"] == "model":
            key = tuple(row[name] for name in _MODEL_KEY)
            groups.setdefault(key, {})[(row["backend"], row["mode"])] = row
    return groups


def _ratio(base: Optional[Row], row: Row) -> Optional[float]:
    return None if base is None or row["median_ms"] <= 0 else base["median_ms"] / row["median_ms"]


def _conv_share(row: Row, by_run: Dict[Tuple[str, str], Row]) -> str:
    """Share of the eager model time spent in the tuned convs (sparse rows), and for the dense
    model the same convs run densely."""
    config = row["config"] if isinstance(row["config"], dict) else {}
    eager = by_run.get((row["backend"], "eager"))
    if not config.get("conv_ms") or eager is None:
        return "—"
    dense_eager = by_run.get((CUDNN, "eager"))
    dense = "" if dense_eager is None else f" (dense {config['dense_conv_ms'] / dense_eager['median_ms']:.0%})"
    return f"{config['conv_ms'] / eager['median_ms']:.0%}{dense}"


def _mode_label(row: Row) -> str:
    """The row's mode, with `torch.compile`'s mode for "compile" rows that record it."""
    config = row["config"] if isinstance(row["config"], dict) else {}
    return f"{row['mode']} ({config['compile_mode']})" if "compile_mode" in config else row["mode"]


def _model_markdown(key: tuple, by_run: Dict[Tuple[str, str], Row]) -> str:
    device, model, n, dtype, sparsity, pattern = key
    dense_modes = [mode for backend, mode in by_run if backend == CUDNN]
    body = []
    for (backend, mode), row in by_run.items():
        error = "—" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
        ratios = [_times(_ratio(by_run.get((CUDNN, dense_mode)), row)) for dense_mode in dense_modes]
        tune = row["config"].get("tune_s") if isinstance(row["config"], dict) else None
        body.append([backend, _mode_label(row), _ms(row), *ratios, error,
                     _conv_share(row, by_run) if mode == "eager" else "",
                     "" if tune is None or mode != "eager" else f"{tune:.1f}"])
    title = f"### {model} · N={n} · {dtype} · sparsity {sparsity:g} · {pattern} · {device}"
    header = ["backend", "mode", "ms", *[f"× vs cuDNN {mode}" for mode in dense_modes], "rel_err",
              "conv share", "tune s"]
    return "\n".join([title, "", _table(header, body), ""])


def markdown_table(rows: Iterable[Row]) -> str:
    """Markdown tables of `rows`: per layer group, cuDNN ms per dtype, each backend's ms and speedup
    over cuDNN at the group's dtype, the worst rel_err, the roofline floor and the fastest backend's
    share of it (floor % = floor ms / ms), then a geomean speedup line; per model group, each
    (backend, mode)'s ms, its speedup over cuDNN in each mode measured, the share of eager time in
    the convs and the tuning time."""
    rows = list(rows)
    parts = [_group_markdown(group) for group in _layer_groups(rows)]
    parts += [_model_markdown(key, by_backend) for key, by_backend in _model_groups(rows).items()]
    return "\n".join(parts)


PLOT_EXTRA_HINT = "plotting needs matplotlib: pip install 'sparsecnn[plot]'"


def _pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError naming the `plot` extra without it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(PLOT_EXTRA_HINT) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish_axes(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    low, high = ax.get_ylim()
    times = FuncFormatter(lambda value, _: f"{value:.3g}×")
    ax.yaxis.set_major_formatter(times)
    ax.yaxis.set_minor_formatter(times if high / low < 10 else NullFormatter())  # minor labels crowd wide ranges
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def _save(plt, fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bars(ax, labels: List[str], series: Dict[str, List[float]]) -> None:
    """Grouped bars growing from 1× (one group per label, one bar per series), legend included."""
    bar = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * bar for x in range(len(labels))],
               [value - 1 for value in values], bar, bottom=1.0, label=name)
    ax.legend(fontsize=7)


def _plotted_layer_groups(rows: List[Row]) -> List[_LayerGroup]:
    return [group for group in _layer_groups(rows)
            if any(group.speedup(layer, b) for layer in group.layers for b in group.backends)]


def _layer_panel(ax, group: _LayerGroup) -> None:
    _bars(ax, group.layers, {backend: [group.speedup(layer, backend) or math.nan for layer in group.layers]
                             for backend in group.backends})
    ax.set_xticks(range(len(group.layers)), group.layers, rotation=60, ha="right", fontsize=7)
    _finish_axes(ax, group.title, f"speedup over cuDNN {group.dtype}")


def _layer_width(groups: List[_LayerGroup]) -> float:
    return max(6.0, 0.35 * max(len(g.layers) * len(g.backends) for g in groups) + 2)


def plot_speedups(rows: Iterable[Row], path: str | os.PathLike) -> Path:
    """Bar chart (PNG) of each backend's speedup over cuDNN per layer, one panel per layer group,
    log scale with a line at 1×. ValueError if no layer has both a backend and a cuDNN row."""
    groups = _plotted_layer_groups(list(rows))
    if not groups:
        raise ValueError("rows: no layer has both a backend row and a cuDNN row to compare")
    plt = _pyplot()
    fig, axes = plt.subplots(len(groups), 1, figsize=(_layer_width(groups), 3.8 * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups):
        _layer_panel(ax, group)
    return _save(plt, fig, path)


def model_speedups(rows: Iterable[Row]) -> Dict[str, Dict[str, float]]:
    """End-to-end speedups of the model rows: "<model> N=<N> <dtype> s=<sparsity>" (plus the
    pattern and device where rows differ in them) -> {"<backend> <mode>": dense ms / ms}, each
    sparse row against the dense (cuDNN) row of the same run and mode. Where rows repeat a
    measurement, the last one counts; rows without such a dense row are left out."""
    model_rows = [row for row in rows if row["kind"] == "model"]
    dense = {(row["run"], row["mode"]) + tuple(row[name] for name in _MODEL_KEY): row
             for row in model_rows if row["backend"] == CUDNN}
    several = {name: len({row[name] for row in model_rows}) > 1 for name in ("pattern", "device")}
    speedups: Dict[str, Dict[str, float]] = {}
    for row in model_rows:
        base = dense.get((row["run"], row["mode"]) + tuple(row[name] for name in _MODEL_KEY))
        ratio = None if row["backend"] == CUDNN else _ratio(base, row)
        if ratio is not None:
            label = (f"{row['model']} N={row['N']} {row['dtype']} s={row['sparsity']:g}"
                     + "".join(f" {row[name]}" for name in ("pattern", "device") if several[name]))
            speedups.setdefault(label, {})[f"{row['backend']} {_mode_label(row)}"] = ratio
    return speedups


def _model_panel(ax, speedups: Dict[str, Dict[str, float]]) -> None:
    labels = list(speedups)
    runs = sorted({run for by_run in speedups.values() for run in by_run})
    _bars(ax, labels, {run: [speedups[label].get(run, math.nan) for label in labels] for run in runs})
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    _finish_axes(ax, "End to end", "speedup over the dense model (same run, same mode)")


def _model_width(speedups: Dict[str, Dict[str, float]]) -> float:
    runs = {run for by_run in speedups.values() for run in by_run}
    return max(6.0, 0.3 * len(speedups) * len(runs) + 2)


def plot_model_speedups(rows: Iterable[Row], path: str | os.PathLike) -> Path:
    """Bar chart (PNG) of `model_speedups`: one group of bars per model (batch, dtype, sparsity),
    one bar per sparse (backend, mode), log scale with a line at 1×. ValueError if no sparse model
    row has a dense row of the same run and mode."""
    speedups = model_speedups(rows)
    if not speedups:
        raise ValueError("rows: no model row has a dense (cudnn) model row of the same run and mode to compare")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(_model_width(speedups), 4.5))
    _model_panel(ax, speedups)
    return _save(plt, fig, path)


def plot_results(rows: Iterable[Row], path: str | os.PathLike) -> Path:
    """One PNG of everything comparable in `rows`: the `plot_speedups` panels of the layer rows,
    then the `plot_model_speedups` panel of the model rows. ValueError if neither has anything."""
    rows = list(rows)
    groups, speedups = _plotted_layer_groups(rows), model_speedups(rows)
    if not groups and not speedups:
        raise ValueError("rows: nothing to plot: no layer has both a backend row and a cuDNN row, and no "
                         "model row has a dense (cudnn) model row of the same run and mode")
    plt = _pyplot()
    heights = [3.8] * len(groups) + ([4.5] if speedups else [])
    width = max(_layer_width(groups) if groups else 0.0, _model_width(speedups) if speedups else 0.0)
    fig, axes = plt.subplots(len(heights), 1, figsize=(width, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, group in zip(axes[:, 0], groups):
        _layer_panel(ax, group)
    if speedups:
        _model_panel(axes[-1, 0], speedups)
    return _save(plt, fig, path)


def _sweeps(rows: Iterable[Row]) -> Dict[tuple, Dict[str, List[Tuple[float, float]]]]:
    """(device, suite, N, dtype, pattern, backend) -> {layer: [(sparsity, speedup)] sorted}."""
    sweeps: Dict[tuple, Dict[str, List[Tuple[float, float]]]] = {}
    for group in _layer_groups(rows):
        for backend in group.backends:
            key = (group.device, group.suite, group.N, group.dtype, group.pattern, backend)
            for layer in group.layers:
                speedup = group.speedup(layer, backend)
                if speedup is not None:
                    sweeps.setdefault(key, {}).setdefault(layer, []).append((group.sparsity, speedup))
    return {key: {layer: sorted(points) for layer, points in lines.items()} for key, lines in sweeps.items()}


def plot_sparsity_sweep(rows: Iterable[Row], path: str | os.PathLike) -> Path:
    """Line plot (PNG) of speedup over cuDNN against sparsity, one line per layer and one panel per
    (device, suite, N, dtype, pattern, backend), log scale with a line at 1×. ValueError if no
    speedup can be computed."""
    sweeps = _sweeps(rows)
    if not sweeps:
        raise ValueError("rows: no layer has both a backend row and a cuDNN row to compare")
    plt = _pyplot()
    fig, axes = plt.subplots(len(sweeps), 1, figsize=(8, 3.8 * len(sweeps)), squeeze=False)
    for ax, (key, lines) in zip(axes[:, 0], sweeps.items()):
        device, suite, n, dtype, pattern, backend = key
        for layer, points in lines.items():
            ax.plot(*zip(*points), marker="o", linewidth=1, markersize=3, label=layer)
        ax.set_xlabel("sparsity")
        _finish_axes(ax, f"{backend} · {suite} · N={n} · {dtype} · {pattern} · {device}",
                     f"speedup over cuDNN {dtype}")
        if len(lines) <= 12:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(plt, fig, path)


def _environment_markdown(rows: List[Row]) -> str:
    envs = dict.fromkeys(tuple(row[name] for name in ("device", "torch", "cudnn", "triton", "driver", "commit"))
                         for row in rows)
    lines = [f"- {device}: torch {torch_version}, cuDNN {cudnn}, Triton {triton}, driver {driver}, commit {commit}"
             for device, torch_version, cudnn, triton, driver, commit in envs]
    runs = dict.fromkeys(row["run"] for row in rows)
    dates = sorted(row["date"] for row in rows)
    lines.append(f"- runs: {', '.join(runs)} ({dates[0]} to {dates[-1]})")
    return "\n".join(lines)


def render_report(rows: Iterable[Row], out_md: str | os.PathLike, plot_dir: str | os.PathLike) -> Path:
    """Write one markdown page to `out_md`: environment, tables (`markdown_table`), and the PNG plots
    (written to `plot_dir`): speedups per layer, end-to-end speedups per model, and speedup vs
    sparsity when rows hold more than one sparsity. Returns the markdown path."""
    rows = list(rows)
    if not rows:
        raise ValueError("rows is empty: nothing to report")
    out_md, plot_dir = Path(out_md), Path(plot_dir)
    parts = ["# Sparse convolution benchmarks", "", _environment_markdown(rows), "", markdown_table(rows)]
    plots = [("Speedup over cuDNN per layer", "speedups.png", plot_speedups),
             ("End-to-end speedup over the dense model (same run, same mode)", "models.png", plot_model_speedups)]
    if len({row["sparsity"] for row in rows if row["kind"] == "layer"}) > 1:
        plots.append(("Speedup over cuDNN against sparsity", "sparsity_sweep.png", plot_sparsity_sweep))
    for title, name, plot in plots:
        try:
            path = plot(rows, plot_dir / name)
        except ValueError:  # nothing to compare: no plot
            continue
        parts += [f"## {title}", "", f"![{title}]({os.path.relpath(path, out_md.parent)})", ""]
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n".join(parts))
    return out_md
