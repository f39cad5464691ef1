"""Probe (issue 45): what bounds the `tensorcore` kernel on ResNet-50's DLMC layers. Times, in one
run against cuDNN fp16 NHWC (bias fused), the backend's kernel at several launches and a variant
kernel that (a) loads each unit's tap and chunk as a vector, so that Triton's software pipeline can
issue the next units' input loads early (the scalar loads of the backend's loop are not pipelined),
and (b) optionally splits each group's reduction over SPLIT programs (fp32 atomics into a workspace,
then a bias + cast kernel), for layers with few pixels and many units. One JSON line per timing.

Usage: python benchmarks/tensorcore_variants_probe.py OUT.jsonl BATCH [LAYER,...|all]
"""
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparsecnn.backends.tensorcore.format import pack_units
from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig, _row_align, unit_conv
from sparsecnn.bench.env import environment, new_run_id
from sparsecnn.bench.patterns import make_weight
from sparsecnn.core.reference import relative_error
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS, get_suite
from sparsecnn.tuning.timing import benchmark

PATTERN = "tiles64x32i-dlmc-magnitude_pruning"


@triton.jit
def _variant_kernel(x_ptr, values_ptr, unit_tap_ptr, unit_chunk_ptr, group_start_ptr, bias_ptr, y_ptr,
                    M, H, W, C, P, Q, K, kernel_w, stride_h, stride_w, pad_h, pad_w, num_groups,
                    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_ALIGN: tl.constexpr,
                    EVEN_C: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % SPLIT
    group = (pid // SPLIT) % num_groups
    offs_m = (pid // (SPLIT * num_groups)) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < M
    q = offs_m % Q
    p = (offs_m // Q) % P
    image = (offs_m // (P * Q)).to(tl.int64) * H * W * C
    h_base = p * stride_h - pad_h
    w_base = q * stride_w - pad_w
    offs_c = tl.arange(0, CHUNK)
    offs_g = tl.arange(0, GROUP)
    zero_m = tl.zeros([BLOCK_M], dtype=tl.int32)
    acc = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    start = tl.load(group_start_ptr + group)
    count = tl.load(group_start_ptr + group + 1) - start
    for unit in range(start + count * split // SPLIT, start + count * (split + 1) // SPLIT):
        tap = tl.load(unit_tap_ptr + unit + zero_m)
        c0 = tl.load(unit_chunk_ptr + unit + zero_m) * CHUNK
        h = h_base + tap // kernel_w
        w = w_base + tap % kernel_w
        inside = in_m & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        row = tl.multiple_of(image + (h * W + w) * C + c0, ROW_ALIGN)
        if EVEN_C:
            a_mask = inside[:, None]
        else:
            a_mask = inside[:, None] & ((c0[:, None] + offs_c[None, :]) < C)
        a = tl.load(x_ptr + row[:, None] + offs_c[None, :], mask=a_mask, other=0.0)
        b = tl.load(values_ptr + unit * (CHUNK * GROUP) + offs_c[:, None] * GROUP + offs_g[None, :])
        acc = tl.dot(a, b, acc)
    channel = group * GROUP + offs_g
    out_offset = offs_m.to(tl.int64)[:, None] * K + channel[None, :]
    out_mask = in_m[:, None] & (channel < K)[None, :]
    if SPLIT == 1:
        acc += tl.load(bias_ptr + channel, mask=channel < K, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out_offset, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(y_ptr + out_offset, acc, mask=out_mask, sem="relaxed")


def variant_conv(x, packed, spec, bias, block_m, warps, stages, split):
    N, C, H, W = x.shape
    K = spec.K
    M = N * spec.P * spec.Q
    y = torch.empty((N, K, spec.P, spec.Q), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    target = y if split == 1 else torch.zeros((M, K), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m) * packed.num_groups * split,)
    _variant_kernel[grid](x, packed.values, packed.unit_tap, packed.unit_chunk, packed.group_start, bias, target,
                          M, H, W, C, spec.P, spec.Q, K, spec.S, spec.stride[0], spec.stride[1],
                          spec.padding[0], spec.padding[1], packed.num_groups,
                          BLOCK_M=block_m, GROUP=packed.group, CHUNK=packed.chunk,
                          ROW_ALIGN=_row_align(C, packed.chunk), EVEN_C=C % packed.chunk == 0, SPLIT=split,
                          num_warps=warps, num_stages=stages)
    if split > 1:
        y.permute(0, 2, 3, 1).reshape(M, K).copy_(target + bias)
    return y


out_path, batch = sys.argv[1], int(sys.argv[2])
wanted = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else list(DLMC_STUDY_LAYERS)
dtype = torch.float16
torch.backends.cudnn.benchmark = True
device = torch.device("cuda")
base = {"run": new_run_id(), "kind": "layer", **environment(device), "suite": "resnet50", "dtype": "fp16",
        "sparsity": 0.9, "mode": "gpu", "pattern": PATTERN}
specs = {s.name: s for s in get_suite("resnet50", batch)}
out = open(out_path, "a")


def emit(spec, backend, config, timing, err, extra=None):
    row = {**base, "layer": spec.name, "N": spec.N, "C": spec.C, "K": spec.K, "H": spec.H, "W": spec.W,
           "R": spec.R, "S": spec.S, "stride": spec.stride[0], "padding": spec.padding[0],
           "backend": backend, "config": config, **timing, "rel_err": err, **(extra or {})}
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(f"{spec.name:22s} {backend:20s} {timing['median_ms'] * 1e3:7.1f} us err {err:.1e} {config}")


for name in wanted:
    spec = specs[name]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.N, spec.C, spec.H, spec.W, generator=gen).to(device, dtype).contiguous(
        memory_format=torch.channels_last)
    bias = torch.randn(spec.K, generator=gen).to(device, dtype)
    weight = make_weight(spec, 0.9, PATTERN, 0, "cpu")[0].to(device, dtype)
    ref = F.conv2d(x.double(), weight.double(), bias.double(), spec.stride, spec.padding)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    dense = lambda: F.conv2d(x, w_cl, bias, spec.stride, spec.padding)
    emit(spec, "cudnn", None, benchmark(dense, device, hide_launch=True), relative_error(dense(), ref))
    for group, chunk in ((64, 32), (32, 32)):
        packed = pack_units(weight, group, chunk, "index")
        counts = (packed.group_start[1:] - packed.group_start[:-1]).tolist()
        extra = {"units": packed.num_units, "max_group_units": max(counts)}
        for block_m, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3)):
            config = TensorCoreConfig(group, chunk, block_m, warps, stages, order="index")
            fn = lambda: unit_conv(x, packed, spec.stride, spec.padding, config, bias=bias)
            emit(spec, "tensorcore", dataclasses.asdict(config), benchmark(fn, device, hide_launch=True),
                 relative_error(fn(), ref), extra)
        splits = (1, 2, 4) if max(counts) >= 6 else (1,)
        for block_m, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 4), (256, 8, 3)):
            for split in splits if (block_m, warps, stages) == (64, 4, 3) else (1,):
                config = {"group": group, "chunk": chunk, "block_m": block_m, "num_warps": warps,
                          "num_stages": stages, "split": split}
                fn = lambda: variant_conv(x, packed, spec, bias, block_m, warps, stages, split)
                emit(spec, "variant-vecmeta", config, benchmark(fn, device, hide_launch=True),
                     relative_error(fn(), ref), extra)
