"""Run one layer through `staged` configs, for Nsight Compute to profile.

Each config runs 3 times on a batch-innermost input and output (as between two batch layers);
profile the third launch: `ncu --clock-control none -k regex:sparsecnn_staged_conv --launch-skip 2
--launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
python scripts/ncu_staged.py --suite pietron-vgg16 --layer vgg-256x56-256 --config 2,4,16,8,8`.
Usage: python scripts/ncu_staged.py --suite S --layer L --config TILE_H,TILE_W,CHUNK_C,ROWS_PER_WARP,WARPS
    [--batch 32] [--pattern random|dlmc-magnitude_pruning]
"""
from __future__ import annotations

import argparse

import torch

from sparsecnn.bench.patterns import make_weight
from sparsecnn.core.batch_inner import batch_inner_view
from sparsecnn.backends.staged import kernel as staged
from sparsecnn.layers import get_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", required=True)
    parser.add_argument("--layer", required=True)
    parser.add_argument("--config", required=True, help="tile_h,tile_w,chunk_c,rows_per_warp,warps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pattern", default="random")
    args = parser.parse_args()
    spec = {s.name: s for s in get_suite(args.suite)}[args.layer].with_batch(args.batch)
    weight, _ = make_weight(spec, 0.9, args.pattern, 0, "cuda")
    x = batch_inner_view(spec.input_shape, torch.float32, torch.device("cuda"))
    x.copy_(torch.randn(spec.input_shape, device="cuda"))
    out = batch_inner_view(spec.output_shape, torch.float32, x.device)
    config = staged.StagedConfig(*(int(v) for v in args.config.split(",")))
    packed = staged.pack_weight(weight, config)
    for _ in range(3):
        staged.staged_conv2d(x, packed, spec.stride, spec.padding, config, out=out)
    torch.cuda.synchronize()
    print(f"{args.layer} {config}: ran 3 times", flush=True)


if __name__ == "__main__":
    main()
