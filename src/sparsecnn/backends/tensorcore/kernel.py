"""Tensor-core sparse convolution: implicit GEMM over each output-channel group's kept units.

One program computes a BLOCK_M x group output tile: BLOCK_M output pixels (n, p, q flattened, NHWC)
by one group of output channels. Its reduction loop visits the group's kept units only (format.py):
per unit, the BLOCK_M x chunk input slab at that tap (contiguous channels in NHWC, zero outside the
image) and the chunk x group weight tile go through `tl.dot` (mma on tensor cores: fp16/bf16 in,
fp32 accumulation; fp32 in as TF32, or exact fp32 FMAs under `precision="ieee"`). Triton's software
pipeline stages both operands in shared memory with asynchronous copies, `num_stages` deep.
Programs are numbered group-fastest, so the groups of one pixel tile run side by side and read its
input from L2 after the first one brought it in. The epilogue adds bias and residual, applies ReLU
and stores through the group's output-channel map (undoing a re-pruning's channel permutation).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch
import triton
import triton.language as tl

from sparsecnn.backends.tensorcore.format import UnitWeights

GROUPS = (16, 32, 64, 128)
CHUNKS = (8, 16, 32, 64)
BLOCK_MS = (32, 64, 128, 256)
PRECISIONS = ("tf32", "ieee")


@dataclasses.dataclass(frozen=True)
class TensorCoreConfig:
    """group: output channels per program (MMA N), one of GROUPS; chunk: input channels per unit
    (MMA K step), one of CHUNKS; block_m: output pixels per program (MMA M), one of BLOCK_MS;
    num_warps 4 or 8; num_stages 2-5 (shared-memory pipeline depth)."""

    group: int = 64
    chunk: int = 32
    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name, allowed in (("group", GROUPS), ("chunk", CHUNKS), ("block_m", BLOCK_MS),
                              ("num_warps", (4, 8)), ("num_stages", (2, 3, 4, 5))):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in allowed:
                raise ValueError(f"TensorCoreConfig.{name} must be one of {allowed}, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TensorCoreConfig":
        return cls(**data)


@triton.jit
def _unit_conv_kernel(x_ptr, values_ptr, unit_tap_ptr, unit_chunk_ptr, group_start_ptr, out_channel_ptr,
                      bias_ptr, residual_ptr, y_ptr,
                      M, H, W, C, P, Q, K, kernel_w, stride_h, stride_w, pad_h, pad_w, num_groups,
                      BLOCK_M: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_ALIGN: tl.constexpr,
                      EVEN_C: tl.constexpr, PERMUTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    group = pid % num_groups
    offs_m = (pid // num_groups) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < M
    q = offs_m % Q
    p = (offs_m // Q) % P
    image = (offs_m // (P * Q)).to(tl.int64) * H * W * C
    h_base = p * stride_h - pad_h
    w_base = q * stride_w - pad_w
    offs_c = tl.arange(0, CHUNK)
    offs_g = tl.arange(0, GROUP)
    acc = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    start = tl.load(group_start_ptr + group)
    end = tl.load(group_start_ptr + group + 1)
    for unit in range(start, end):
        tap = tl.load(unit_tap_ptr + unit)
        c0 = tl.load(unit_chunk_ptr + unit) * CHUNK
        h = h_base + tap // kernel_w
        w = w_base + tap % kernel_w
        inside = in_m & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        row = tl.multiple_of(image + (h * W + w) * C + c0, ROW_ALIGN)
        if EVEN_C:
            a_mask = inside[:, None]
        else:
            a_mask = inside[:, None] & ((c0 + offs_c) < C)[None, :]
        a = tl.load(x_ptr + row[:, None] + offs_c[None, :], mask=a_mask, other=0.0)
        b = tl.load(values_ptr + unit * (CHUNK * GROUP) + offs_c[:, None] * GROUP + offs_g[None, :])
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if PERMUTED:
        channel = tl.load(out_channel_ptr + group * GROUP + offs_g)
        channel_ok = channel >= 0
    else:
        channel = group * GROUP + offs_g
        channel_ok = channel < K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    out_offset = offs_m.to(tl.int64)[:, None] * K + channel[None, :]
    out_mask = in_m[:, None] & channel_ok[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + out_offset, mask=out_mask, other=0.0).to(tl.float32)
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + out_offset, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _row_align(channels: int, chunk: int) -> int:
    """The largest power of two (at most 16) dividing every row offset image + pixel * C + c0."""
    return min(16, math.gcd(channels, chunk) & -math.gcd(channels, chunk))


def output_shape(x_shape, kernel_shape, stride, padding) -> tuple:
    """(N, K, P, Q) of a convolution of an (N, C, H, W) input (dilation 1)."""
    N, _, H, W = x_shape
    K, _, R, S = kernel_shape
    return (N, K, (H + 2 * padding[0] - R) // stride[0] + 1, (W + 2 * padding[1] - S) // stride[1] + 1)


def unit_conv(x: torch.Tensor, packed: UnitWeights, stride, padding, config: TensorCoreConfig,
              bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
              relu: bool = False, precision: str = "tf32", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = relu?(conv(x, W) + bias + residual) with W in units (format.py); dilation 1, groups 1.

    x: (N, C, H, W) in channels_last memory, fp16/bf16/fp32 (fp32: `precision` "tf32" or "ieee").
    bias: (K,) or None; residual: (N, K, P, Q) channels_last of x's dtype or None.
    Returns (N, K, P, Q) in channels_last memory, x's dtype (written into `out` when given).
    """
    if config.group != packed.group or config.chunk != packed.chunk:
        raise ValueError(f"config (group {config.group}, chunk {config.chunk}) does not match the packed weight "
                         f"(group {packed.group}, chunk {packed.chunk})")
    N, C, H, W = x.shape
    K = packed.kernel_shape[0]
    shape = output_shape(x.shape, packed.kernel_shape, stride, padding)
    y = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device,
                                                memory_format=torch.channels_last)
    M = N * shape[2] * shape[3]
    if M == 0:
        return y
    grid = (triton.cdiv(M, config.block_m) * packed.num_groups,)
    _unit_conv_kernel[grid](
        x, packed.values, packed.unit_tap, packed.unit_chunk, packed.group_start, packed.out_channel,
        bias if bias is not None else y, residual if residual is not None else y, y,
        M, H, W, C, shape[2], shape[3], K, packed.kernel_shape[3], stride[0], stride[1], padding[0], padding[1],
        packed.num_groups,
        BLOCK_M=config.block_m, GROUP=config.group, CHUNK=config.chunk, ROW_ALIGN=_row_align(C, config.chunk),
        EVEN_C=C % config.chunk == 0, PERMUTED=packed.permuted, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, RELU=relu, PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def candidate_configs(group: int, chunk: int) -> List[TensorCoreConfig]:
    """The launch configs the tuner times for a weight packed at (group, chunk)."""
    return [TensorCoreConfig(group, chunk, block_m, warps, stages)
            for block_m, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 4), (256, 8, 3))]
