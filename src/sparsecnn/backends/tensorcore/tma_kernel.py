"""Tensor-core sparse convolution through TMA: the unit kernel for stride-1 layers, spatial tiles.

One program computes a TILE_H x TILE_W block of output pixels of one image by one group of
output channels. Per kept unit (tap r, s; input channels c0 .. c0 + chunk) it loads the input box
[n, p0 + r - pad_h .. + TILE_H, q0 + s - pad_w .. + TILE_W, c0 .. + chunk] with one tensor-memory-
accelerator copy: the hardware zero-fills whatever lies outside the image (the padding) or past C,
so there is no per-row address arithmetic and no mask, and the box lands in shared memory where the
MMA (wgmma on Hopper) reads it. The weight tile comes the same way, and the output tile leaves
through one TMA store that drops rows past P, Q and channels past K. Bias, residual and ReLU are
fused as in `kernel.py`. Stride 1 only: TMA boxes step one element per row. `unit_conv` picks this
kernel where `tma_eligible` holds and the pointer kernel elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sparsecnn.backends.tensorcore.format import code_row

TILE_SHAPES = ((8, 8), (4, 16), (8, 16), (16, 8))  # (TILE_H, TILE_W): BLOCK_M 64 or 128 output pixels


def unit_slots(max_units: int) -> int:
    """Register slots for a group's unit codes: its `unit_code` row (`format.code_row`), or 0 (codes
    loaded one by one in the loop) past 64 units, where the register copy would cost more than it saves."""
    slots = code_row(max_units)
    return slots if slots <= 64 else 0


@triton.jit
def group_units(group_start_ptr, unit_code_ptr, code_row, group, SLOTS: tl.constexpr):
    """(start, end, codes) of `group`: its units are start .. end - 1; with SLOTS > 0 its row of the
    `unit_code` table, (SLOTS,) int32, copied into registers. The three loads depend on `group`
    only, so they are in flight together (a ranged list would wait for `start` first)."""
    start = tl.load(group_start_ptr + group)
    end = tl.load(group_start_ptr + group + 1)
    codes = tl.load(unit_code_ptr + group * code_row + tl.arange(0, max(SLOTS, 1)))
    return start, end, codes


@triton.jit
def unit_at(unit_code_ptr, code_row, group, codes, index, present, CHUNK: tl.constexpr, SLOTS: tl.constexpr):
    """(tap, first input channel) of the group's unit number `index` (0-based): from the register
    copy `group_units` made when SLOTS > 0, so the next units' operand loads, which the software
    pipeline issues ahead, wait on no memory access for their addresses; else loaded from the
    table. (0, 0) where `present` is False (a unit past the group's end in an unrolled loop)."""
    if SLOTS > 0:
        code = tl.sum(tl.where(tl.arange(0, SLOTS) == index, codes, 0), axis=0)
    else:
        code = tl.load(unit_code_ptr + group * code_row + index, mask=present, other=0)
    return code & 0xFFFF, (code >> 16) * CHUNK


@triton.jit
def _tma_unit_conv_kernel(x_desc, w_desc, y_desc, residual_desc, bias_ptr, unit_code_ptr, code_row,
                          group_start_ptr, K, tiles_p, tiles_q, num_groups, kernel_w, pad_h, pad_w,
                          TILE_H: tl.constexpr, TILE_W: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr,
                          PRECISION: tl.constexpr, SLOTS: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    group = pid % num_groups
    tile = pid // num_groups
    q0 = (tile % tiles_q) * TILE_W
    p0 = (tile // tiles_q % tiles_p) * TILE_H
    n = tile // (tiles_q * tiles_p)
    channel = group * GROUP + tl.arange(0, GROUP)
    if HAS_BIAS:  # loaded before the loop, so its latency hides behind the units'
        bias = tl.load(bias_ptr + channel, mask=channel < K, other=0.0).to(tl.float32)
    acc = tl.zeros((TILE_H * TILE_W, GROUP), dtype=tl.float32)
    start, end, codes = group_units(group_start_ptr, unit_code_ptr, code_row, group, SLOTS)
    if USE_GDC:  # as in kernel.py: weights above, x and residual (perhaps the kernel before's output) below
        tl.extra.cuda.gdc_wait()
    for unit in range(start, end):
        tap, c0 = unit_at(unit_code_ptr, code_row, group, codes, unit - start, unit < end, CHUNK, SLOTS)
        r = tap // kernel_w
        a = x_desc.load([n, p0 + r - pad_h, q0 + tap - r * kernel_w - pad_w, c0])
        b = w_desc.load([unit * CHUNK, 0])
        acc = tl.dot(a.reshape(TILE_H * TILE_W, CHUNK), b, acc, input_precision=PRECISION)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += bias[None, :]
    if HAS_RESIDUAL:
        acc += residual_desc.load([n, p0, q0, group * GROUP]).reshape(TILE_H * TILE_W, GROUP).to(tl.float32)
    if RELU:
        acc = tl.maximum(acc, 0.0)
    y_desc.store([n, p0, q0, group * GROUP],
                 acc.to(y_desc.dtype).reshape(1, TILE_H, TILE_W, GROUP))


def tma_shape_ok(C: int, K: int, stride, itemsize: int, chunk: int, group: int) -> bool:
    """Whether a layer's shape suits `tma_unit_conv`: stride 1, every TMA row stride a multiple of
    16 bytes (C and K channels of x and y), box rows (chunk, group channels) of at most 128 bytes."""
    return (tuple(stride) == (1, 1) and (C * itemsize) % 16 == 0 and (K * itemsize) % 16 == 0
            and chunk * itemsize <= 128 and group * itemsize <= 128)


def tma_eligible(x: torch.Tensor, residual: Optional[torch.Tensor], kernel_shape, stride, chunk: int,
                 group: int, permuted: bool) -> bool:
    """Whether `tma_unit_conv` can run this call: `tma_shape_ok`, channels in index order, x and
    residual 16-byte aligned (TMA base addresses)."""
    return (tma_shape_ok(kernel_shape[1], kernel_shape[0], stride, x.element_size(), chunk, group)
            and not permuted and x.data_ptr() % 16 == 0 and (residual is None or residual.data_ptr() % 16 == 0))


def pick_tile(P: int, Q: int, block_m: int) -> tuple:
    """(TILE_H, TILE_W) of `block_m` pixels for a P x Q output: the one wasting the fewest pixels
    past the image edge, then the widest (TMA rows)."""
    shapes = [s for s in TILE_SHAPES if s[0] * s[1] == block_m] or [TILE_SHAPES[0]]
    return min(shapes, key=lambda s: (triton.cdiv(P, s[0]) * s[0] * triton.cdiv(Q, s[1]) * s[1], -s[1]))


def tma_unit_conv(x: torch.Tensor, values: torch.Tensor, unit_code: torch.Tensor, group_start: torch.Tensor,
                  kernel_shape, padding, y: torch.Tensor, group: int, chunk: int,
                  block_m: int, num_warps: int, num_stages: int, precision: str, max_units: int,
                  bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], relu: bool,
                  pdl: bool = False) -> torch.Tensor:
    """Write act(conv(x) + bias + residual) into `y` for a stride-1 layer (`tma_eligible`).

    x: (N, C, H, W) channels_last, y and residual: (N, K, P, Q) channels_last, values: (U, chunk,
    group) of x's dtype; unit_code, group_start and max_units as in `format.UnitWeights`; pdl: launch
    with programmatic dependent launch (`kernel.dependent_launch`). Returns y.
    """
    N, C, H, W = x.shape
    K, _, _, S = kernel_shape
    P, Q = y.shape[2], y.shape[3]
    tile_h, tile_w = pick_tile(P, Q, block_m)
    x_nhwc = x.permute(0, 2, 3, 1)
    y_nhwc = y.permute(0, 2, 3, 1)
    if values.shape[0] == 0:  # no kept unit: the descriptor still needs one box of rows
        values = torch.zeros(1, chunk, group, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x_nhwc, [1, tile_h, tile_w, chunk])
    w_desc = TensorDescriptor.from_tensor(values.reshape(-1, group), [chunk, group])
    y_desc = TensorDescriptor.from_tensor(y_nhwc, [1, tile_h, tile_w, group])
    residual_desc = (y_desc if residual is None else
                     TensorDescriptor.from_tensor(residual.permute(0, 2, 3, 1), [1, tile_h, tile_w, group]))
    tiles_p, tiles_q = triton.cdiv(P, tile_h), triton.cdiv(Q, tile_w)
    num_groups = group_start.numel() - 1
    grid = (N * tiles_p * tiles_q * num_groups,)
    _tma_unit_conv_kernel[grid](
        x_desc, w_desc, y_desc, residual_desc, bias if bias is not None else y, unit_code, unit_code.shape[1],
        group_start,
        K, tiles_p, tiles_q, num_groups, S, padding[0], padding[1],
        TILE_H=tile_h, TILE_W=tile_w, GROUP=group, CHUNK=chunk, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, RELU=relu, PRECISION=precision, SLOTS=unit_slots(max_units),
        USE_GDC=pdl, launch_pdl=pdl, num_warps=num_warps, num_stages=num_stages)
    return y
