"""Experiment (session 14): is a split-K GEMM faster than F.linear for the classifiers at batch 32, fp32?

VGG16's tuned forward (N=32, fp32) spent 0.49 ms of ~10 ms in cuBLAS's sgemm for the 25088 -> 4096
linear (`benchmarks/results/2026-11-23-h100-s14-profile-edc7a91.jsonl`): with 32 rows, its 128 x 64
tiles give 32 blocks for 132 SMs. Split-K: x (M, S, K/S) and the weight (O, S, K/S) as S batched
GEMMs, then a sum over S. Per shape: F.linear and S = 2..32, medians with the L2 flushed, relative
error against fp64. TF32 off. Usage: PYTHONPATH=src python ...-s14-splitk-linear.py OUT.jsonl
"""
import json
import sys

import torch
import torch.nn.functional as F

from sparsecnn.autotune import benchmark
from sparsecnn.bench.env import environment

torch.backends.cuda.matmul.allow_tf32 = False
SHAPES = {"vgg16.classifier.0": (25088, 4096), "vgg16.classifier.3": (4096, 4096), "vgg16.classifier.6": (4096, 1000),
          "resnet50.fc": (2048, 1000), "googlenet.fc": (1024, 1000)}


def split_k(x, weight, bias, splits):
    k = x.shape[1] // splits
    parts = torch.bmm(x.view(-1, splits, k).transpose(0, 1), weight.view(weight.shape[0], splits, k).permute(1, 2, 0))
    return parts.sum(0).add_(bias)


def main():
    env = {**environment("cuda"), "kind": "experiment", "experiment": "split-K linear", "dtype": "fp32"}
    with open(sys.argv[1], "a") as out:
        for name, (fan_in, fan_out) in SHAPES.items():
            for batch in (32, 128):
                x = torch.randn(batch, fan_in, device="cuda")
                weight = torch.randn(fan_out, fan_in, device="cuda") / fan_in ** 0.5
                bias = torch.randn(fan_out, device="cuda")
                ref = F.linear(x.double(), weight.double(), bias.double())
                row = {**env, "layer": name, "N": batch}
                for splits in (1, 2, 4, 8, 16, 32):
                    if fan_in % splits:
                        continue
                    fn = (lambda: F.linear(x, weight, bias)) if splits == 1 else (
                        lambda: split_k(x, weight, bias, splits))
                    err = ((fn().double() - ref).norm() / ref.norm()).item()
                    ms = benchmark(fn, torch.device("cuda"), warmup_ms=25, rep_ms=100, hide_launch=True)["median_ms"]
                    row[f"S{splits}_ms"], row[f"S{splits}_err"] = round(ms, 4), err
                print(json.dumps({k: v for k, v in row.items() if k not in env}), flush=True)
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
