"""Session 19 analysis (CPU): how far issues 3 and 4 are from their targets, against hardware bounds.

Reads the session's H100 results (benchmarks/results/2026-11-25-h100-s19-*) and prints markdown:
1. Issue 3, fp32: `direct` (and the better of `direct` / `staged`) over cuDNN fp32 per suite at
   N >= 32, with the bound of a kernel doing one L1 gather per multiply-add (32 fp32 values per
   clock per SM, 132 SMs, 1.98 GHz).
2. Issue 3, fp16: `direct` over cuDNN fp16 channels_last on the layers that are memory-bound for
   dense cuDNN fp16 (bytes / measured copy bandwidth > flops / measured fp16 matmul rate), with the
   bound max(sparse bytes / bandwidth, non-zero FMAs / L1 gather rate of 64 fp16 values per clock).
3. Issue 4: `blocks` over cuDNN fp16 channels_last, and two bounds of `blocks` with its own block
   decomposition (t2 4 or 8, the better): "free blocks" (the remainder alone on `direct`, blocks
   costing nothing) and "hardware" (blocks at the tensor cores' peak, 989 dense fp16 TFLOP/s, plus
   the remainder at the L1 gather floor, or the layer's bytes at the measured copy bandwidth if
   that takes longer).
Usage: PYTHONPATH=src python benchmarks/experiments/2026-11-25-s19-bounds.py
"""
import collections
import json
import math
from pathlib import Path

from sparsecnn.layers import get_suite

RESULTS = Path(__file__).resolve().parents[1] / "results"
SM_CLOCKS = 132 * 1.98e9
L1_FP32, L1_FP16 = 32 * SM_CLOCKS, 64 * SM_CLOCKS   # values gathered per second at 128 B / clock / SM
TENSOR_FMA = 989e12 / 2                             # H100 SXM dense fp16 FMAs per second
SPARSITY = 0.9


def geomean(values):
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def load(name):
    return [json.loads(line) for line in open(RESULTS / name)]


def layer_specs():
    return {(suite, spec.name): spec for suite in ("dong", "pietron-r50-1x1", "optprune-resnet18-cifar", "resnet50",
                                                   "pietron-vgg16") for spec in get_suite(suite)}


def output_positions(spec):
    n, _, p, q = spec.output_shape
    return n * p * q


def best_times(rows, dtype):
    """{(suite, layer, N): {backend: best median ms}} for `dtype` rows ("cudnn" is that dtype's cuDNN)."""
    best = collections.defaultdict(dict)
    for row in rows:
        if row["dtype"] == dtype:
            times = best[row["suite"], row["layer"], row["N"]]
            times[row["backend"]] = min(times.get(row["backend"], math.inf), row["median_ms"])
    return best


def span(values):
    """'geomean (min-max)' of positive ratios."""
    values = list(values)
    return f"{geomean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def fp32_table(specs):
    print("| suite | layers | `direct` geomean (range) | better of `direct` / `staged` | L1 gather bound |")
    print("|---|---:|---|---:|---:|")
    by_suite = collections.defaultdict(list)
    rows = load("2026-11-25-h100-s19-direct-staged-fp32-3b5c6d2.jsonl")
    for (suite, layer, n), times in best_times(rows, "fp32").items():
        spec = specs[suite, layer].with_batch(n)
        floor_ms = (1 - SPARSITY) * spec.dense_flops / 2 / L1_FP32 * 1e3
        fastest_ms = min(times["direct"], times.get("staged", math.inf))
        cudnn = times["cudnn"]
        by_suite[f"{suite} N={n}"].append((cudnn / times["direct"], cudnn / fastest_ms, cudnn / floor_ms))
    every = [ratios for values in by_suite.values() for ratios in values]
    for suite, values in [*by_suite.items(), ("all", every)]:
        direct, fastest, bound = zip(*values)
        print(f"| {suite} | {len(values)} | {span(direct)} | {geomean(fastest):.2f}x | {geomean(bound):.2f}x |")


def fp16_table(specs):
    ceilings = load("2026-11-25-h100-s19-ceilings.jsonl")[0]
    bandwidth, tensor_rate = ceilings["copy_GBps"] * 1e9, ceilings["fp16_TFLOPs"] * 1e12
    print("| suite | memory-bound layers | `direct` fp16 geomean (range) | bound | share of the bound reached |"
          " layers whose bound < 1.5x |")
    print("|---|---:|---|---:|---:|---:|")
    by_suite = collections.defaultdict(list)
    for (suite, layer, n), times in best_times(load("2026-11-25-h100-s19-direct-fp16-681e21a.jsonl"), "fp16").items():
        spec = specs[suite, layer].with_batch(n)
        if spec.min_bytes(2, 1.0) / bandwidth <= spec.dense_flops / tensor_rate:
            continue
        floor_s = max(spec.min_bytes(2, 1 - SPARSITY) / bandwidth, (1 - SPARSITY) * spec.dense_flops / 2 / L1_FP16)
        by_suite[f"{suite} N={n}"].append((times["cudnn"] / times["direct"], times["cudnn"] / (floor_s * 1e3)))
    large = [v for suite, values in by_suite.items() if not suite.endswith(" N=1") for v in values]
    for suite, values in [*by_suite.items(), ("all at N >= 32", large)]:
        reached, bound = zip(*values)
        print(f"| {suite} | {len(values)} | {span(reached)} | "
              f"{geomean(bound):.2f}x | {geomean(r / b for r, b in values):.2f} | {sum(b < 1.5 for b in bound)} |")


def blocks_table(specs):
    bandwidth = load("2026-11-25-h100-s19-ceilings.jsonl")[0]["copy_GBps"] * 1e9
    print("| suite | layers | `blocks` fp16 | free-blocks bound | hardware bound | mean share in blocks (t2 4 / 8) |"
          " mean fill of layers with blocks (t2 4 / 8) |")
    print("|---|---:|---:|---:|---:|---|---|")
    by_suite = collections.defaultdict(list)
    for row in load("2026-11-25-h100-s19-blocks-remainder-e9a861b.jsonl"):
        spec = specs[row["suite"], row["layer"]].with_batch(row["N"])
        cudnn, positions = row["cudnn_fp16_cl_ms"], output_positions(spec)
        parts = [row[f"t2={t2}"] for t2 in (4, 8)]
        cells = [p["share_in_blocks"] * row["nnz"] / p["fill"] if p["fill"] else 0.0 for p in parts]
        compute_ms = min(c * positions / TENSOR_FMA * 1e3 + p["remainder_floor_ms"] for c, p in zip(cells, parts))
        hardware_ms = max(compute_ms, spec.min_bytes(2, 1 - SPARSITY) / bandwidth * 1e3)
        free_ms = min(p["remainder_direct_ms"] for p in parts)
        free = cudnn / free_ms if free_ms else math.inf
        by_suite[row["suite"]].append((cudnn / row["blocks_ms"], free, cudnn / hardware_ms, parts))
    for suite, values in by_suite.items():
        reached, free, hardware, parts = zip(*values)
        share = [sum(p[i]["share_in_blocks"] for p in parts) / len(parts) for i in (0, 1)]
        fills = [[p[i]["fill"] for p in parts if p[i]["fill"]] for i in (0, 1)]
        fill = [sum(f) / len(f) if f else 0.0 for f in fills]
        print(f"| {suite} | {len(values)} | {geomean(reached):.2f}x | {geomean(free):.2f}x | {span(hardware)} | "
              f"{share[0]:.2f} / {share[1]:.2f} | {fill[0]:.2f} / {fill[1]:.2f} |")


def gather_table():
    print("| layer | N | cuDNN fp32 ms | `direct` \"batch\" ms | tl.gather kernel ms (best of 6 configs) |"
          " over `direct` |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in load("2026-11-25-h100-s19-gather-direct-e9a861b.jsonl"):
        print(f"| {row['layer']} | {row['N']} | {row['cudnn_ms']:.3f} | {row['direct_batch_ms']:.3f} | "
              f"{row['gather_best_ms']:.3f} ({row['gather_best']}) | {row['gather_vs_direct']:.2f}x |")


def main():
    specs = layer_specs()
    tables = (("Issue 3, fp32 over cuDNN fp32 (TF32 off), sparsity 0.9", lambda: fp32_table(specs)),
              ("Issue 3, fp16 over cuDNN fp16 channels_last, memory-bound layers", lambda: fp16_table(specs)),
              ("Issue 3, the tl.gather kernel (fp32)", gather_table),
              ("Issue 4, fp16 over cuDNN fp16 channels_last, sparsity 0.9", lambda: blocks_table(specs)))
    for title, table in tables:
        print(f"\n### {title}\n")
        table()


if __name__ == "__main__":
    main()
