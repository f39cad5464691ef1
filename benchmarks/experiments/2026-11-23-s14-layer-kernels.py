"""Experiment (session 14): which kernels run inside each conv layer of a tuned model, and for how long.

The tuned DLMC ResNet-50 (fp32, N=32) spent 0.256 ms in layer2.0.conv2 (`staged`) and 0.209 ms in
layer2.0.downsample.0 (`direct` "batch") per forward, against 0.134 and 0.122 ms for the same kernels
timed alone on batch-innermost inputs (`benchmarks/results/2026-11-23-h100-s14-profile-edc7a91.jsonl`,
`...-s13-staged-b47b328.jsonl`). Tunes the model as `sparsecnn bench model` does, profiles eager
calls with every `SparseConv2d` in a record_function range, and attributes each GPU kernel to the
range whose GPU-side annotation contains its start. Prints, per layer (slowest first), its kernels
with their time per call.
Usage: PYTHONPATH=src python ...-s14-layer-kernels.py resnet50 --pattern dlmc-magnitude_pruning --out OUT.jsonl
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sparsecnn.bench.env import environment
from sparsecnn.bench.layers import precision
from sparsecnn.bench.models import _input, _pruned_model, _variant

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from profile_model_kernels import RUNS, annotate_convs, layer_kernel_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--pattern", default="random")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, label, sparsity = _pruned_model(args.model, 0.9, args.pattern, 0, None)
    x = _input(args.model, 32, 0, torch.device("cuda"), "fp32")
    sparse, x, config = _variant(model.cuda(), x, "fp32", "auto", None)
    annotate_convs(sparse)
    with precision("fp32"), torch.no_grad():
        for _ in range(3):
            sparse(x)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(RUNS):
                sparse(x)
            torch.cuda.synchronize()
    per_layer = layer_kernel_ms(prof)
    totals = {layer: sum(kernels.values()) for layer, kernels in per_layer.items()}
    for layer in sorted(totals, key=totals.get, reverse=True)[:20]:
        print(f"{layer:28s} {totals[layer]:.4f} ms  " + "; ".join(
            f"{name[:80]} {ms:.4f}" for name, ms in per_layer[layer].most_common(4)))
    with open(args.out, "a") as out:
        out.write(json.dumps({**environment("cuda"), "kind": "experiment", "model": args.model, "pattern": label,
                              "sparsity": sparsity, "N": 32, "dtype": "fp32",
                              "layer_kernels_ms": {k: dict(v) for k, v in per_layer.items()},
                              "layers": {k: {"backend": v["backend"], "config": v["config"]}
                                         for k, v in config["layers"].items()}}) + "\n")


if __name__ == "__main__":
    main()
