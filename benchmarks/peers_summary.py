"""RESULTS.md's peer tables and headline.json's "peers ..." entries from the rows of
`sparsecnn bench layers --peers NAME` (issue 33): per layer, our fastest backend against each peer variant.

Usage: python benchmarks/peers_summary.py [--headline PATH] RESULTS_FILE.jsonl ...
For every (suite, dtype, N), from the file of its newest run: one markdown line per layer (cuDNN at the
same dtype, our fastest backend and its time, every peer variant's time, in microseconds), then the
geomean of our speedup over each variant; last, one summary line per cell, which also gives our speedup
over cuDNN at PyTorch's default for the dtype (TF32 convs for fp32). Rewrites the headline entries
"peers <suite> <dtype> N=<n>: ours vs <variant>" (other entries unchanged; an entry's "readme" flag is
kept, new ones get False), in the per-layer geomean form `tests/benchmarks/test_headline.py` recomputes. "Ours" is every backend
of the run that is neither cuDNN, a dense baseline nor a peer; a cell's layers come from one file, each
layer from one run.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from sparsecnn.bench.peers import PEER_PREFIX

HEADLINE = Path(__file__).parent / "results" / "headline.json"
CUDNN = "cudnn"
Cell = Tuple[str, str, int]  # (suite, dtype, N)


def is_ours(backend: str) -> bool:
    """Whether rows of `backend` are one of our sparse backends (not cuDNN, a dense one or a peer)."""
    return backend != CUDNN and not backend.startswith(("dense", PEER_PREFIX))


def newest_cells(paths: Sequence[str]) -> Dict[Cell, Tuple[str, List[str], List[dict]]]:
    """{(suite, dtype, N): (path, runs, rows)} per cell that has peer rows: the file of the cell's newest
    run (by date), and in it, per layer, the newest run with that layer's peer rows (one run per layer
    keeps every ratio within one run; a benchmark may run each layer in its own process). The cell's
    dtype is that of its peer rows; its rows include cuDNN's at any dtype."""
    runs: Dict[Tuple[str, str], List[dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                runs.setdefault((path, row["run"]), []).append(row)
    # {cell: {(path, layer): (date, run)}}: the newest run of each layer, per file
    newest: Dict[Cell, Dict[Tuple[str, str], Tuple[str, str]]] = {}
    for (path, run), rows in runs.items():
        for row in rows:
            if row.get("kind") == "layer" and row["backend"].startswith(PEER_PREFIX):
                layers = newest.setdefault((row["suite"], row["dtype"], row["N"]), {})
                key = (path, row["layer"])
                layers[key] = max(layers.get(key, (row["date"], run)), (row["date"], run))
    cells: Dict[Cell, Tuple[str, List[str], List[dict]]] = {}
    for cell, layers in newest.items():
        path = max(layers.items(), key=lambda item: item[1])[0][0]
        picked = {layer: run for (where, layer), (_, run) in layers.items() if where == path}
        rows = [row for run in sorted(set(picked.values())) for row in runs[(path, run)]
                if (row["suite"], row["N"]) == (cell[0], cell[2]) and picked.get(row["layer"]) == run]
        devices = {row["device"] for row in rows}
        if len(devices) != 1:
            raise ValueError(f"{path}: cell {cell} mixes devices {sorted(devices)}")
        cells[cell] = (path, sorted(set(picked.values())), rows)
    return cells


def layer_table(rows: List[dict], dtype: str) -> Dict[str, Dict[str, dict]]:
    """{layer: {"cudnn" | "ours" | "peer:<variant>": row}}: cuDNN and peers at `dtype`, ours the fastest
    row of our backends at `dtype`."""
    layers: Dict[str, Dict[str, dict]] = {}
    for row in rows:
        if row.get("kind") != "layer" or row["dtype"] != dtype:
            continue
        slot = layers.setdefault(row["layer"], {})
        key = "ours" if is_ours(row["backend"]) else row["backend"]
        if key in slot and key != "ours":
            raise ValueError(f"two {key} rows for layer {row['layer']} at {dtype} in run {row['run']}")
        if key != "ours" or key not in slot or row["median_ms"] < slot[key]["median_ms"]:
            slot[key] = row
    return layers


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def speedups(layers: Dict[str, Dict[str, dict]], variant: str) -> List[float]:
    """Our speedup over peer row `variant` on each layer where both ran."""
    return [slot[variant]["median_ms"] / slot["ours"]["median_ms"]
            for slot in layers.values() if "ours" in slot and variant in slot]


def entry(cell: Cell, path: str, runs: List[str], rows: List[dict], layers: Dict[str, Dict[str, dict]],
          variant: str) -> dict:
    """The headline entry of our fastest backend per layer over peer row `variant` in `cell`."""
    suite, dtype, batch = cell
    ours = sorted({row["backend"] for row in rows if is_ours(row["backend"]) and row["dtype"] == dtype})
    ratios = speedups(layers, variant)
    compared = [name for name, slot in layers.items() if "ours" in slot and variant in slot]
    first = next(slot["ours"] for slot in layers.values() if "ours" in slot and variant in slot)
    peer_config = next(slot[variant]["config"] for slot in layers.values() if variant in slot)
    return {
        "name": f"peers {suite} {dtype} N={batch}: ours vs {variant[len(PEER_PREFIX):]}",
        "what": f"our fastest of {', '.join(ours)} per layer, {dtype}, geomean over {len(ratios)} {suite} layers "
                f"({first['pattern']}, sparsity {first['sparsity']:.2f}), N={batch}",
        "ours_ms": None,
        "baseline": f"peer {variant[len(PEER_PREFIX):]} on the same layers, masks and inputs (config {peer_config})",
        "baseline_ms": None,
        "ratio": round(geomean(ratios), 3),
        "device": first["device"], "commit": first["commit"], "date": first["date"][:10], "file": str(Path(path)),
        "versions": {name: first[name] for name in ("torch", "cudnn", "triton", "driver")},
        "rows": {"N": len(ratios), "backends": ours, "baseline_backend": variant, "baseline_dtype": dtype,
                 "dtype": dtype, "ours_pick": "fastest row per layer over the backends and their configs",
                 "runs": runs, "suites": [[suite, batch]], "layers": compared},
    }


def _us(row: Optional[dict]) -> str:
    return f"{row['median_ms'] * 1000:.1f}" if row else "-"


def print_cell(cell: Cell, path: str, layers: Dict[str, Dict[str, dict]], variants: Sequence[str]) -> None:
    suite, dtype, batch = cell
    names = [variant[len(PEER_PREFIX):] for variant in variants]
    print(f"\n{suite}, {dtype}, N={batch} (`{Path(path).name}`; times in us)\n")
    print("| layer | cuDNN | ours | ours: backend | " + " | ".join(names) + " |")
    print("|---|---:|---:|---|" + "---:|" * len(names))
    for layer, slot in layers.items():
        if not any(variant in slot for variant in variants):
            continue
        print(f"| {layer} | {_us(slot.get(CUDNN))} | {_us(slot.get('ours'))} | "
              f"{slot['ours']['backend'] if 'ours' in slot else '-'} | "
              + " | ".join(_us(slot.get(variant)) for variant in variants) + " |")
    for variant in variants:
        ratios = speedups(layers, variant)
        if ratios:
            print(f"ours over {variant[len(PEER_PREFIX):]}: geomean {geomean(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}x, {len(ratios)} layers)")


def cudnn_default_speedups(rows: List[dict], layers: Dict[str, Dict[str, dict]], dtype: str) -> List[float]:
    """Our speedup per layer over cuDNN at PyTorch's default for `dtype` (TF32 convs for fp32, as
    `torch.backends.cudnn.allow_tf32` is on by default; fp16 and bf16 as they are), same run."""
    default = layer_table(rows, "tf32" if dtype == "fp32" else dtype)
    return [default[name][CUDNN]["median_ms"] / slot["ours"]["median_ms"] for name, slot in layers.items()
            if "ours" in slot and CUDNN in default.get(name, {})]


def _ratio_cell(ratios: Optional[List[float]]) -> str:
    return f"{geomean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x, {len(ratios)})" if ratios else "-"


def print_summary(summary: List[Tuple[Cell, Dict[str, List[float]]]]) -> None:
    """One line per cell: our geomean speedup (range, layers) over each peer variant, and over cuDNN at
    PyTorch's default for the cell's dtype (key CUDNN)."""
    variants = sorted({variant for _, ratios in summary for variant in ratios} - {CUDNN})
    print("\n| suite, dtype, N | " + " | ".join(f"ours over {v[len(PEER_PREFIX):]}" for v in variants)
          + " | ours over cuDNN at PyTorch's default (TF32 for fp32) |")
    print("|---|" + "---:|" * (len(variants) + 1))
    for (suite, dtype, batch), ratios in summary:
        print(f"| {suite}, {dtype}, {batch} | " + " | ".join(_ratio_cell(ratios.get(v)) for v in variants)
              + f" | {_ratio_cell(ratios.get(CUDNN))} |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSON-lines files of `bench layers --peers` runs")
    parser.add_argument("--headline", type=Path, default=HEADLINE, help="headline.json to update")
    args = parser.parse_args(argv)
    headline = json.loads(args.headline.read_text())
    flags = {item["name"]: item.get("readme", False) for item in headline["entries"]}
    made, summary = {}, []
    for cell, (path, runs, rows) in sorted(newest_cells(args.files).items()):
        layers = layer_table(rows, cell[1])
        variants = sorted({key for slot in layers.values() for key in slot if key.startswith(PEER_PREFIX)})
        print_cell(cell, path, layers, variants)
        summary.append((cell, {**{variant: speedups(layers, variant) for variant in variants},
                               CUDNN: cudnn_default_speedups(rows, layers, cell[1])}))
        for variant in variants:
            if not speedups(layers, variant):
                continue
            item = entry(cell, path, runs, rows, layers, variant)
            made[item["name"]] = {**item, "readme": flags.get(item["name"], False)}
    print_summary(summary)
    kept = [made.pop(item["name"], item) for item in headline["entries"]]
    headline["entries"] = kept + list(made.values())
    args.headline.write_text(json.dumps(headline, indent=1) + "\n")


if __name__ == "__main__":
    main()
