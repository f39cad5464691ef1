"""Session 19 (CPU): paper 003 Tables 6-8 in their shape (layer time in ms: cuDNN float / half
against the direct sparse convolution float / half, batch 128), from this session's H100 runs.

Tables 6 (VGG16) and 7 (ResNet-50 1x1) at sparsity 0.9, random masks, from
`2026-11-25-h100-s19-direct-staged-fp32-3b5c6d2.jsonl` (float) and `...-direct-fp16-681e21a.jsonl`
(half); Table 8 (the 1-D layer) at the paper's sparsities from `...-cnn1d-a63c7c4.jsonl`. `direct`
is its fastest auto config; cuDNN half runs channels_last. Usage:
PYTHONPATH=src python benchmarks/experiments/2026-11-25-s19-paper003-tables.py
"""
import collections
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
FLOAT_FILE = "2026-11-25-h100-s19-direct-staged-fp32-3b5c6d2.jsonl"
HALF_FILE = "2026-11-25-h100-s19-direct-fp16-681e21a.jsonl"
CNN1D_FILE = "2026-11-25-h100-s19-cnn1d-a63c7c4.jsonl"


def best_ms(files):
    """{(suite, layer, N, sparsity, dtype, backend): fastest median ms} over the files' rows."""
    best = collections.defaultdict(lambda: float("inf"))
    for name in files:
        for line in open(RESULTS / name):
            row = json.loads(line)
            key = (row["suite"], row["layer"], row["N"], row["sparsity"], row["dtype"], row["backend"])
            best[key] = min(best[key], row["median_ms"])
    return best


def times(best, suite, layer, n, sparsity):
    """(cuDNN float, direct float, cuDNN half, direct half) ms."""
    return tuple(best[suite, layer, n, sparsity, dtype, backend]
                 for dtype, backend in (("fp32", "cudnn"), ("fp32", "direct"), ("fp16", "cudnn"), ("fp16", "direct")))


def table_row(label, values):
    cudnn_f, direct_f, cudnn_h, direct_h = values
    return (f"| {label} | {cudnn_f:.3f} | {direct_f:.3f} ({cudnn_f / direct_f:.2f}x) | {cudnn_h:.3f} | "
            f"{direct_h:.3f} ({cudnn_h / direct_h:.2f}x) |")


def main():
    header = ("| {} | cuDNN float ms | direct float ms (speedup) | cuDNN half ms | direct half ms (speedup) |\n"
              "|---|---:|---:|---:|---:|")
    layers = {"Table 6 (VGG16)": ("pietron-vgg16", ["vgg-64x224-64", "vgg-64x112-128", "vgg-128x112-128",
                                                    "vgg-128x56-256", "vgg-256x56-256", "vgg-256x28-512",
                                                    "vgg-512x28-512", "vgg-512x14-512"]),
              "Table 7 (ResNet-50 1x1)": ("pietron-r50-1x1", ["r50-1x1-64-256", "r50-1x1-256-64"])}
    best = best_ms([FLOAT_FILE, HALF_FILE])
    for title, (suite, names) in layers.items():
        print(f"\n### {title}, N=128, sparsity 0.9, random\n")
        print(header.format("layer"))
        for name in names:
            print(table_row(name, times(best, suite, name, 128, 0.9)))
    best = best_ms([CNN1D_FILE])
    print("\n### Table 8 (1-D layer, 64 channels x 300, kernel 2 or 3), N=128, random\n")
    print(header.format("layer, sparsity"))
    for name in ("cnn1d-64x300-k2", "cnn1d-64x300-k3"):
        for sparsity in (0.77, 0.83, 0.875, 0.9):
            print(table_row(f"{name}, {sparsity:g}", times(best, "pietron-cnn1d", name, 128, sparsity)))


if __name__ == "__main__":
    main()
