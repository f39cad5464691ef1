"""Run one DLMC ResNet-50 layer through direct "batch" configs, for Nsight Compute to profile.

Each config runs 3 times (batch-innermost input and output, as between two batch layers); profile
the third launch of each: `ncu --clock-control none -k regex:_direct_batch_kernel --launch-skip 2
...
python scripts/ncu_direct_batch.py --layer L --configs PIX,W;...` (one config per ncu run is simplest).
Usage: python scripts/ncu_direct_batch.py --layer layer2.1.conv2 --configs "4,1;8,1" [--batch 32]
"""
from __future__ import annotations

import argparse

import torch

from sparsecnn.backends import get_backend
from sparsecnn.bench.patterns import make_weight
from sparsecnn.core.batch_inner import batch_inner_view
from sparsecnn.backends.direct import kernel as direct_conv
from sparsecnn.layers import get_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", required=True)
    parser.add_argument("--configs", required=True, help="';'-separated block_pix,num_warps (chunk 8)")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    spec = {s.name: s for s in get_suite("resnet50")}[args.layer].with_batch(args.batch)
    weight, _ = make_weight(spec, 0.9, "dlmc-magnitude_pruning", 0, "cuda")
    x = batch_inner_view(spec.input_shape, torch.float32, torch.device("cuda"))
    x.copy_(torch.randn(spec.input_shape, device="cuda"))
    out = batch_inner_view(spec.output_shape, torch.float32, x.device)
    for text in args.configs.split(";"):
        block_pix, warps = (int(v) for v in text.split(","))
        config = direct_conv.DirectConfig(block_pix, 1, min(32, args.batch), warps, 1, "batch", 8)
        packed = get_backend("direct").prepare(weight, config)
        for _ in range(3):
            direct_conv.direct_conv2d(x, packed, None, spec.stride, spec.padding, config, out=out)
        torch.cuda.synchronize()
        print(f"{args.layer} block_pix={block_pix} num_warps={warps}: ran", flush=True)


if __name__ == "__main__":
    main()
