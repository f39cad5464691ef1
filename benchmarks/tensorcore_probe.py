"""Probe (issue 45): the `tensorcore` kernel on ResNet-50's layer shapes, against cuDNN NHWC (bias
fused) and torch.sparse BSR (PyTorch's Triton kernel) on the same masks, fp16 unless DTYPE says
otherwise. One JSON line per measurement.

PATTERN "units" (default): per packing, 90% of units pruned at random per group of channels in
index order. Any other PATTERN is a `bench.patterns` one (e.g. tiles64x32-dlmc-magnitude_pruning,
DLMC masks re-pruned into tiles; SPARSECNN_DLMC points at the masks): every packing is then timed
twice, its channels in support order (`format.support_order`, stores through the channel map) and
in index order (contiguous stores), to show what the permuted epilogue costs.

Usage: python benchmarks/tensorcore_probe.py OUT.jsonl BATCH [DTYPE] [LAYER,...|all] [PATTERN]
"""
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
from torch.sparse._triton_ops import bsr_dense_mm

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.bench.patterns import make_weight
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, unit_conv
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS, get_suite
from sparsecnn.tuning.timing import benchmark

PATTERNS = ((64, 32), (32, 32), (128, 32), (64, 16), (64, 64))  # (group, chunk) packings
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32}

out_path, batch = sys.argv[1], int(sys.argv[2])
dtype_name = sys.argv[3] if len(sys.argv) > 3 else "fp16"
wanted = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] != "all" else list(DLMC_STUDY_LAYERS)
mask_pattern = sys.argv[5] if len(sys.argv) > 5 else "units"
dtype = DTYPES[dtype_name]
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = True
torch.backends.cuda.matmul.allow_tf32 = True
device = torch.device("cuda")
base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50", "dtype": dtype_name,
        "sparsity": 0.9, "mode": "gpu"}
specs = {s.name: s for s in get_suite("resnet50", batch)}
out = open(out_path, "a")


def unit_mask(K, C, R, S, group, chunk, density, gen):
    """Per group of output channels, round(density * units) random units kept; (K, C, R, S) bool."""
    groups, chunks = -(-K // group), -(-C // chunk)
    keep = max(1, round(density * chunks * R * S))
    scores = torch.rand(groups, chunks * R * S, generator=gen)
    kept = torch.zeros_like(scores, dtype=torch.bool)
    kept.scatter_(1, scores.topk(keep, dim=1).indices, True)
    full = kept.reshape(groups, 1, chunks, 1, R, S).expand(groups, group, chunks, chunk, R, S)
    return full.reshape(groups * group, chunks * chunk, R, S)[:K, :C].contiguous()


def emit(spec, backend, pattern, config, timing, err, extra=None):
    row = {**base, "sparsity": sparsity, "layer": spec.name, "N": spec.N, "C": spec.C, "K": spec.K, "H": spec.H, "W": spec.W,
           "R": spec.R, "S": spec.S, "stride": spec.stride[0], "padding": spec.padding[0], "pattern": pattern,
           "backend": backend, "config": config, **timing, "rel_err": err, **(extra or {})}
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(f"{spec.name:24s} {backend:14s} {pattern:14s} {timing['median_ms']:.4f} ms err {err:.1e} {config}")


def im2col_rsc(x_cl, spec):
    """(R*S*C, N*P*Q) columns of an NHWC input, reduction ordered (r, s, c)."""
    N, C, H, W = x_cl.shape
    ph, pw = spec.padding
    xp = F.pad(x_cl.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph)).contiguous()
    Hp, Wp = H + 2 * ph, W + 2 * pw
    sh, sw = spec.stride
    view = xp.as_strided((spec.R, spec.S, C, N, spec.P, spec.Q),
                         (Wp * C, C, 1, Hp * Wp * C, sh * Wp * C, sw * C))
    return view.reshape(spec.R * spec.S * C, N * spec.P * spec.Q)


for name in wanted:
    spec = specs[name]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(device, dtype).contiguous(
        memory_format=torch.channels_last)
    values = torch.randn(spec.K, spec.C, spec.R, spec.S, generator=gen)
    bias = torch.randn(spec.K, generator=gen).to(device, dtype)
    given = None if mask_pattern == "units" else make_weight(spec, 0.9, mask_pattern, 0, "cpu")[0]
    for group, chunk in PATTERNS:
        mask = unit_mask(spec.K, spec.C, spec.R, spec.S, group, chunk, 0.1, gen) if given is None else given != 0
        weight = (values * mask).to(device, dtype)
        ref = F.conv2d(x.double(), weight.double(), bias.double(), spec.stride, spec.padding)
        pattern = f"units{group}x{chunk}" if given is None else mask_pattern
        sparsity = 1.0 - float(mask.float().mean())
        if (group, chunk) == PATTERNS[0]:
            w_cl = weight.contiguous(memory_format=torch.channels_last)
            fn = lambda: F.conv2d(x, w_cl, bias, spec.stride, spec.padding)
            emit(spec, "cudnn", pattern, None, benchmark(fn, device, hide_launch=True), relative_error(fn(), ref))
        for order in ("index",) if given is None else ("index", "support"):
            packed = pack_units(weight, group, chunk, order)
            for block_m, warps, stages in ((64, 4, 3), (128, 4, 3), (32, 4, 3)):
                config = TensorCoreConfig(group, chunk, block_m, warps, stages, order=order)
                fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config, bias=bias)
                y = fn()
                emit(spec, "tensorcore", pattern, dataclasses.asdict(config),
                     benchmark(fn, device, hide_launch=True), relative_error(y, ref),
                     {"units": packed.num_units, "permuted": packed.permuted})
        if dtype != torch.float32 and chunk >= 16 and spec.K % group == 0 and spec.C % chunk == 0:
            flat = weight.permute(0, 2, 3, 1).reshape(spec.K, -1)
            bsr = flat.to_sparse_bsr((group, chunk))
            cols = im2col_rsc(x, spec)
            mm = lambda: bsr_dense_mm(bsr, cols)
            emit(spec, "torch-bsr-mm", pattern, {"blocksize": [group, chunk]}, benchmark(mm, device, hide_launch=True),
                 float("nan"))
            full = lambda: bsr_dense_mm(bsr, im2col_rsc(x, spec))
            y = full().reshape(spec.K, spec.N, spec.P, spec.Q).permute(1, 0, 2, 3) + bias[:, None, None]
            emit(spec, "torch-bsr", pattern, {"blocksize": [group, chunk]}, benchmark(full, device, hide_launch=True),
                 relative_error(y, ref))
