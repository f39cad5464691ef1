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
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from sparsecnn.backends.tensorcore.format import ORDERS, UnitWeights, padded_work
from sparsecnn.backends.tensorcore.tma_kernel import (TILE_SHAPES, group_units, tma_eligible, tma_shape_ok,
                                                      tma_unit_conv, unit_at, unit_slots)
import sparsecnn.settings as settings
from sparsecnn.core import device
from sparsecnn.core.checks import check_residual, check_triton_input, config_from_dict
from sparsecnn.core.op_support import output_shape

GROUPS = (16, 32, 64, 128)
CHUNKS = (16, 32, 64)  # tl.dot needs a reduction step of at least 16 for fp16/bf16
BLOCK_MS = (32, 64, 128, 256)
UNROLLS = (1, 2, 4)
PRECISIONS = ("ieee", "tf32", "tf32x3")
LOADS = ("pointer", "tma")


@dataclasses.dataclass(frozen=True)
class TensorCoreConfig:
    """group: output channels per program (MMA N), one of GROUPS; chunk: input channels per unit
    (MMA K step), one of CHUNKS; block_m: output pixels per program (MMA M), one of BLOCK_MS;
    num_warps 4 or 8; num_stages 2-5 (shared-memory pipeline depth); precision: how fp32 inputs
    are multiplied, "ieee" (exact, FMA units), "tf32" (tensor cores, inputs rounded to TF32, as
    PyTorch's default convolutions may) or "tf32x3" (tensor cores, each input split into two TF32
    parts, three MMAs: fp32-level error); fp16/bf16 always run on tensor cores and carry "ieee";
    order: how output channels are grouped (`format.pack_units`), "support" (fewest units, stores
    through a channel map) or "index" (channel runs, contiguous stores); loads: how operands reach
    shared memory, "pointer" (this module's kernel: gathered rows of BLOCK_M flattened pixels) or
    "tma" (`tma_kernel`: boxes of a spatial tile of block_m pixels through the tensor memory
    accelerator, where `tma_kernel.tma_eligible` holds; the pointer kernel elsewhere);
    unroll: units per loop iteration of the pointer kernel, one of UNROLLS (their loads issue
    together, so a group's serial chain of load latencies is that many times shorter).
    (group, chunk, order) shape the packed weight (`packing`); the others only the launch."""

    group: int = 64
    chunk: int = 32
    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "ieee"
    order: str = "support"
    loads: str = "pointer"
    unroll: int = 1

    def __post_init__(self):
        for name, allowed in (("group", GROUPS), ("chunk", CHUNKS), ("block_m", BLOCK_MS),
                              ("num_warps", (4, 8)), ("num_stages", (2, 3, 4, 5)), ("precision", PRECISIONS),
                              ("order", ORDERS), ("loads", LOADS), ("unroll", UNROLLS)):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in allowed:
                raise ValueError(f"TensorCoreConfig.{name} must be one of {allowed}, got {value!r}")
        tma_block_ms = sorted({h * w for h, w in TILE_SHAPES})
        if self.loads == "tma" and self.block_m not in tma_block_ms:
            raise ValueError(f"TensorCoreConfig.block_m must be one of {tma_block_ms} with loads='tma' (spatial "
                             f"tiles {TILE_SHAPES}), got {self.block_m}")

    @property
    def packing(self) -> Tuple[int, int, str]:
        """(group, chunk, order): what a `UnitWeights` is packed for."""
        return self.group, self.chunk, self.order

    @classmethod
    def from_dict(cls, saved: dict) -> "TensorCoreConfig":
        """Rebuild from `dataclasses.asdict` output (unknown keys are an error)."""
        return config_from_dict(cls, saved)


@triton.jit
def _unit_conv_kernel(x_ptr, values_ptr, unit_code_ptr, code_row, group_start_ptr, out_channel_ptr,
                      bias_ptr, residual_ptr, y_ptr,
                      M, H, W, C, P, Q, K, kernel_w, stride_h, stride_w, pad_h, pad_w, num_groups,
                      x2_ptr, group_split_ptr, H2, W2, C2, stride2_h, stride2_w,
                      BLOCK_M: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, ROW_ALIGN: tl.constexpr,
                      EVEN_C: tl.constexpr, PERMUTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr,
                      SLOTS: tl.constexpr, UNROLL: tl.constexpr, USE_GDC: tl.constexpr,
                      SHORTCUT: tl.constexpr, ROW_ALIGN2: tl.constexpr, EVEN_C2: tl.constexpr):
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
    if PERMUTED:
        channel = tl.load(out_channel_ptr + group * GROUP + offs_g)
        channel_ok = channel >= 0
    else:
        channel = group * GROUP + offs_g
        channel_ok = channel < K
    if HAS_BIAS:  # loaded before the loop, so its latency hides behind the units'
        bias = tl.load(bias_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    start, end, codes = group_units(group_start_ptr, unit_code_ptr, code_row, group, SLOTS)
    if SHORTCUT:  # the group's units past `split` are the shortcut's (format.pack_shortcut_units)
        split = tl.load(group_split_ptr + group)
    else:
        split = end
    if USE_GDC:  # the loads above read this layer's weights; x and residual may come from the kernel before
        tl.extra.cuda.gdc_wait()
    for first in range(start, split, UNROLL):
        for step in tl.static_range(UNROLL):
            unit = first + step
            present = unit < split  # the last iteration of an unrolled loop may pass the group's end
            tap, c0 = unit_at(unit_code_ptr, code_row, group, codes, unit - start, present, CHUNK, SLOTS)
            h = h_base + tap // kernel_w
            w = w_base + tap % kernel_w
            inside = in_m & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            if UNROLL > 1:  # one unit per iteration never passes `end`: its loads stay unmasked, as measured
                inside = inside & present
            row = tl.multiple_of(image + (h * W + w) * C + c0, ROW_ALIGN)
            if EVEN_C:
                a_mask = inside[:, None]
            else:
                a_mask = inside[:, None] & ((c0 + offs_c) < C)[None, :]
            a = tl.load(x_ptr + row[:, None] + offs_c[None, :], mask=a_mask, other=0.0)
            b_pointers = values_ptr + unit * (CHUNK * GROUP) + offs_c[:, None] * GROUP + offs_g[None, :]
            if UNROLL > 1:
                b = tl.load(b_pointers, mask=present, other=0.0)
            else:
                b = tl.load(b_pointers)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if SHORTCUT:  # a 1x1 conv of x2 at stride2, pad 0: its pixel for output (p, q) is (p * stride2, q * stride2)
        pixel2 = (offs_m // (P * Q)).to(tl.int64) * H2 * W2 * C2 + (p * stride2_h * W2 + q * stride2_w) * C2
        for unit in range(split, end):
            _, c0 = unit_at(unit_code_ptr, code_row, group, codes, unit - start, True, CHUNK, SLOTS)
            row = tl.multiple_of(pixel2 + (c0 - C), ROW_ALIGN2)
            if EVEN_C2:
                a_mask = in_m[:, None]
            else:
                a_mask = in_m[:, None] & ((c0 - C + offs_c) < C2)[None, :]
            a = tl.load(x2_ptr + row[:, None] + offs_c[None, :], mask=a_mask, other=0.0)
            b = tl.load(values_ptr + unit * (CHUNK * GROUP) + offs_c[:, None] * GROUP + offs_g[None, :])
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if USE_GDC:  # the next layer's programs may start their weight loads while this one stores
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += bias[None, :]
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


def launch_precision(dtype: torch.dtype, config: TensorCoreConfig) -> str:
    """The kernel's PRECISION: the config's ("ieee", "tf32" or "tf32x3") for fp32 inputs, else "ieee"."""
    return config.precision if dtype == torch.float32 else "ieee"


def dependent_launch(x: torch.Tensor) -> bool:
    """Whether the kernels launch with programmatic dependent launch (PDL) for input `x`: on a GPU
    of compute capability 9.0 or newer, unless `settings.pdl()` is off. The launch then lets a
    layer's programs start while the kernel before it drains: they load their unit lists, channel
    map and bias, and wait (griddepcontrol.wait) before reading x or the residual, which that
    kernel may write; their stores come after the wait."""
    return x.is_cuda and dependent_launch_on(x.device)


def dependent_launch_on(cuda_device: torch.device) -> bool:
    """`dependent_launch` for an input on `cuda_device` (a CUDA device)."""
    return settings.pdl() and torch.cuda.get_device_capability(cuda_device) >= (9, 0)


def unit_conv(x: torch.Tensor, packed: UnitWeights, stride, padding, config: TensorCoreConfig,
              bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
              relu: bool = False, shortcut: Optional[torch.Tensor] = None, shortcut_stride=(1, 1)) -> torch.Tensor:
    """y = relu?(conv(x, W) + bias + residual [+ conv(shortcut, W2, shortcut_stride)]) with W in
    units (format.py); dilation 1, groups 1.

    x: (N, C, H, W) fp16/bf16/fp32 on CUDA (CPU with TRITON_INTERPRET=1), channels_last memory
    (another layout is copied to it). bias: (K,) or None; residual: (N, K, P, Q) of x's dtype or None.
    stride, padding: (h, w) pairs. shortcut: (N, C2, H2, W2) of x's dtype, given exactly when
    `packed` holds a shortcut weight W2 (`format.pack_shortcut_units`): its 1x1 conv at
    `shortcut_stride`, padding 0, must give the output's (P, Q) pixels; it runs in the same
    reduction (pointer kernel). Returns (N, K, P, Q) in channels_last memory, x's dtype.
    """
    if config.packing[:2] != (packed.group, packed.chunk):
        raise ValueError(f"config packing (group, chunk) = {config.packing[:2]} does not match the packed weight's "
                         f"{(packed.group, packed.chunk)}; prepare the weight for this config")
    check_triton_input(x, "tensorcore", (torch.float32, torch.float16, torch.bfloat16))
    if x.shape[1] != packed.kernel_shape[1]:
        raise ValueError(f"x has {x.shape[1]} channels, the weight expects {packed.kernel_shape[1]}")
    x = x.contiguous(memory_format=torch.channels_last)
    shape = output_shape(x, packed.kernel_shape, stride, padding)
    check_residual(residual, shape, x)
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if residual is not None:
        residual = residual.contiguous(memory_format=torch.channels_last)
    shortcut = _checked_shortcut(shortcut, shortcut_stride, packed, x, shape)
    if y.numel() == 0:
        return y
    precision = launch_precision(x.dtype, config)
    pdl = dependent_launch(x)
    if shortcut is None and config.loads == "tma" and tma_eligible(x, residual, packed.kernel_shape, stride,
                                                                   packed.chunk, packed.group, packed.permuted):
        return tma_unit_conv(x, packed.values, packed.unit_code, packed.group_start,
                             packed.kernel_shape, padding, y, packed.group, packed.chunk, config.block_m,
                             config.num_warps, config.num_stages, precision, packed.max_units, bias, residual, relu,
                             pdl)
    operands = (x, packed.values, packed.unit_code, packed.group_start, packed.out_channel,
                bias if bias is not None else y, residual if residual is not None else y, y)
    grid, args, meta = pointer_launch(operands, x.shape, shape[2:], packed, stride, padding, config, precision,
                                      (bias is not None, residual is not None, relu), pdl,
                                      _shortcut_args(shortcut, shortcut_stride, packed))
    _unit_conv_kernel[grid](*args, **meta)
    return y


def pointer_launch(operands: tuple, x_shape, out_hw, packed: UnitWeights, stride, padding, config: TensorCoreConfig,
                   precision: str, epilogue: Tuple[bool, bool, bool], pdl: bool,
                   shortcut: Optional[tuple] = None) -> Tuple[tuple, tuple, dict]:
    """(grid, args, meta) of `_unit_conv_kernel` for input shape (N, C, H, W) and output (P, Q).

    operands: (x, values, unit_code, group_start, out_channel, bias, residual, y), bias and
    residual standing in as y when absent; tensors, or their dtypes for a compile without launch
    (`compile_ahead`). epilogue: (has_bias, has_residual, relu). shortcut: `_shortcut_args`' (x2,
    group_split, H2, W2, C2, stride2_h, stride2_w), or None. `unit_conv` launches with these and
    `compile_ahead` compiles with them, so both reach the same compiled kernel."""
    N, C, H, W = x_shape
    P, Q = out_hw
    M = N * P * Q
    has_bias, has_residual, relu = epilogue
    x, values, unit_code, group_start, out_channel, bias, residual, y = operands
    stand_ins = (x, group_start, 1, 1, 1, 1, 1)  # never read; ints of 1 Triton specializes: no extra compile
    args = (x, values, unit_code, packed.unit_code.shape[1], group_start, out_channel, bias, residual, y,
            M, H, W, C, P, Q, packed.kernel_shape[0], packed.kernel_shape[3], stride[0], stride[1], padding[0],
            padding[1], packed.num_groups, *(shortcut or stand_ins))
    meta = dict(BLOCK_M=config.block_m, GROUP=config.group, CHUNK=config.chunk, ROW_ALIGN=_row_align(C, config.chunk),
                EVEN_C=C % config.chunk == 0, PERMUTED=packed.permuted, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual,
                RELU=relu, PRECISION=precision, SLOTS=unit_slots(packed.max_units), UNROLL=config.unroll,
                USE_GDC=pdl, SHORTCUT=shortcut is not None,
                ROW_ALIGN2=_row_align(packed.shortcut_channels or 16, config.chunk),
                EVEN_C2=packed.shortcut_channels % config.chunk == 0, launch_pdl=pdl, num_warps=config.num_warps,
                num_stages=config.num_stages)
    return (triton.cdiv(M, config.block_m) * packed.num_groups,), args, meta


def _checked_shortcut(shortcut: Optional[torch.Tensor], stride, packed: UnitWeights, x: torch.Tensor,
                      out_shape) -> Optional[torch.Tensor]:
    """`shortcut` in channels_last memory after checking it against `packed` and the output shape
    (ValueError naming what differs)."""
    if (shortcut is None) != (packed.shortcut_channels == 0):
        raise ValueError(f"shortcut must be given exactly when the packed weight holds one (it holds "
                         f"{packed.shortcut_channels} shortcut channels), got {'none' if shortcut is None else 'one'}")
    if shortcut is None:
        return None
    N, K, P, Q = out_shape
    if shortcut.dim() != 4 or shortcut.shape[:2] != (N, packed.shortcut_channels) or shortcut.dtype != x.dtype:
        raise ValueError(f"shortcut must be (N={N}, C2={packed.shortcut_channels}, H2, W2) of {x.dtype}, got "
                         f"{tuple(shortcut.shape)} of {shortcut.dtype}")
    sh, sw = stride
    if N and not ((P - 1) * sh < shortcut.shape[2] <= P * sh and (Q - 1) * sw < shortcut.shape[3] <= Q * sw):
        raise ValueError(f"shortcut of {tuple(shortcut.shape[2:])} pixels at stride {tuple(stride)} does not give the "
                         f"output's {(P, Q)}")
    return shortcut.contiguous(memory_format=torch.channels_last)


def _shortcut_args(shortcut: Optional[torch.Tensor], stride, packed: UnitWeights) -> Optional[tuple]:
    """The kernel's (x2, group_split, H2, W2, C2, stride2_h, stride2_w), or None without a shortcut."""
    if shortcut is None:
        return None
    _, C2, H2, W2 = shortcut.shape
    return shortcut, packed.group_split, H2, W2, C2, stride[0], stride[1]


# (block_m, num_warps, num_stages) per launch. Probe on ResNet-50's layers (H200, fp16, N=32,
# benchmarks/results/2026-11-28-h200-tensorcore-probe-fp16-4598191.jsonl): (64, 4, 3) won 45 of 56
# (layer, packing) cells; keeping 4 warps and 3 stages lost at most 1% where others won.
_LAUNCHES = ((64, 4, 3), (128, 4, 3), (32, 4, 3))
# (group, chunk) packings: 64 x 32 and 64 x 64 won most layers of the probe, 128 x 32 and 64 x 16 a few.
_PACKINGS = ((64, 32), (64, 64), (32, 32), (64, 16), (128, 32))
# Launches of the TMA kernel (stride-1 layers). Probe (H200, fp16, N=32, 12 stride-1 DLMC layers,
# benchmarks/results/2026-11-29-h200-tensorcore-loads-fp16-n32-register-units.jsonl): within 9% of the pointer
# kernel on every layer, ahead by 7-8% on two (layer1.0.conv2, layer1.0.conv3).
_TMA_LAUNCHES = ((64, 4, 3), (128, 4, 3))
# Launch (block_m, num_warps, num_stages, unroll) for layers with fewer pixel tiles of 64 than the
# GPU has SMs, where a group's serial chain of unit loads sets the time. Probe (H200, fp16, N=32,
# benchmarks/results/2026-12-04-h200-tensorcore-launch-probe-fp16-n32-c78de62.jsonl): 4 units per
# iteration took layer4.0.conv2 14.7 -> 12.4 us and layer4.1.conv2 15.6 -> 12.7 us (7x7 pixels, 25
# tiles), and cost 1.2-2.1x on every layer of 98 or more tiles.
_SMALL_GRID_LAUNCH = (64, 4, 3, 4)


def _few_pixel_tiles(spec) -> bool:
    """Whether the layer has fewer pixel tiles of `_SMALL_GRID_LAUNCH`'s block_m than the current
    GPU (an H100 without one) has SMs."""
    return spec.N * spec.P * spec.Q < _SMALL_GRID_LAUNCH[0] * device.resolve(None).sm_count


def _operands_fit(block_m: int, group: int, chunk: int, num_stages: int, unroll: int, itemsize: int) -> bool:
    """Whether num_stages copies of an iteration's operands (unroll x (block_m x chunk input +
    chunk x group weights), itemsize bytes each) fit the current GPU's shared memory per block: a
    bound on what Triton's pipeline allocates. Unrolled fp32 launches of wide packings exceed it
    (H200: the 64 x 64 packing at 4 units and 3 stages asked for 256 KB of 227 KB)."""
    needed = num_stages * unroll * (block_m * chunk + chunk * group) * itemsize
    return needed <= device.resolve(None).max_shared_per_block_optin


def candidate_configs(spec, dtype: torch.dtype) -> List[TensorCoreConfig]:
    """Configs for the autotuner, default first: every packing of _PACKINGS whose group and chunk
    do not exceed the layer's K and C (rounded up to a power of two, at least 16), in both channel
    orders (support order packs fewer units, index order stores contiguously: which wins is
    measured), with every launch of _LAUNCHES; index-order packings at _SMALL_GRID_LAUNCH where the
    layer has fewer pixel tiles than the GPU has SMs and the operands fit shared memory; then, where
    `tma_kernel.tma_shape_ok` holds for the layer in `dtype`, each index-order packing through the
    TMA kernel at _TMA_LAUNCHES. fp32 configs come twice, "ieee" and "tf32x3" (the tuner adds "tf32"
    variants where the precision policy allows)."""
    groups = max(16, 1 << (spec.K - 1).bit_length())
    chunks = max(16, 1 << (spec.C - 1).bit_length())
    packings = list(dict.fromkeys((min(g, groups), min(c, chunks)) for g, c in _PACKINGS))
    configs = [TensorCoreConfig(g, c, m, w, st, order=order) for order in ("support", "index")
               for g, c in packings for m, w, st in _LAUNCHES]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if _few_pixel_tiles(spec):
        block_m, warps, stages, unroll = _SMALL_GRID_LAUNCH
        configs += [TensorCoreConfig(g, c, block_m, warps, stages, order="index", unroll=unroll) for g, c in packings
                    if _operands_fit(block_m, g, c, stages, unroll, itemsize)]
    configs += [TensorCoreConfig(g, c, m, w, st, order="index", loads="tma") for g, c in packings
                if tma_shape_ok(spec.C, spec.K, spec.stride, itemsize, c, g) for m, w, st in _TMA_LAUNCHES]
    if dtype == torch.float32:  # 3xTF32: fp32-level error on tensor cores, for every fp32 policy
        configs += [dataclasses.replace(config, precision="tf32x3") for config in configs]
    return list(dict.fromkeys(configs))


# A layer is not timed on tensorcore where even its packing of least work pads over this fraction of
# the dense MMA work (K x C x R x S per output pixel): on the DLMC layers at 10% density it ran 1.5x
# (fp16) and 1.9x (TF32) faster than cuDNN, so it breaks even near 15-19% of the dense work. On
# unstructured masks every unit holds a non-zero, and every packing pads the dense work.
MAX_WORK_FRACTION = 0.5


def least_work_configs(weight: torch.Tensor, configs: List[TensorCoreConfig]) -> List[TensorCoreConfig]:
    """Of `configs` (each launch kept), those whose packing pads the least MMA work for `weight`
    (`format.padded_work`, index order): the tuner times only these; none where that work is over
    MAX_WORK_FRACTION of the dense layer's. Replayed on every auto config's recorded time on the 16
    DLMC layers in 64 x 32 tiles (H200, N=32: fp16 414b038, bf16 and TF32 c5815d0; N=1 fp16 c5815d0,
    files in benchmarks/results): the fastest kept config is the fastest of all on every TF32 layer,
    on 13 of 16 fp16 and bf16 layers and 12 of 16 at N=1, and within 7% elsewhere (where 128 x 32
    or 64 x 64, padding 1.5-2x the work, won). Among the packings of least work the fastest differs
    by dtype (64 x 32 in fp16, 32 x 32 in TF32), so all of them stay. Each packing left out saves
    its compiles in tuning. The dense work counts C rounded up to the smallest chunk, as the reduction
    runs it, so a layer of few channels (ResNet-50's conv1, C = 3) is judged against the work its
    units really run. weight: (K, C, R, S) with zeros."""
    work = {packing: padded_work(weight, *packing[:2]) for packing in dict.fromkeys(c.packing for c in configs)}
    least = min(work.values())
    K, C, R, S = weight.shape
    if least > MAX_WORK_FRACTION * K * _padded_channels(C) * R * S:
        return []
    return [config for config in configs if work[config.packing] == least]


def _padded_channels(channels: int) -> int:
    """`channels` rounded up to the smallest unit chunk: the input channels a tensor-core reduction runs
    over, dense or sparse (a first layer of C = 3 multiplies 16 per tap, zeros included)."""
    return -(-channels // CHUNKS[0]) * CHUNKS[0]


def auto_configs(spec, dtype: torch.dtype) -> List[TensorCoreConfig]:
    """What `backend="auto"` tries: every packing in index order at the default launch (the probe's
    most frequent winner, within 1% elsewhere), so tuning a model costs one compile per packing
    that `least_work_configs` keeps for the layer's weight, and at _SMALL_GRID_LAUNCH where
    `candidate_configs` offers it (a second compile per packing); for
    fp32 the TF32 variants, which the tuner offers only under a policy that allows TF32, and the 3xTF32
    ones (fp32-level error: offered under every fp32 policy, e.g. where PyTorch's default fp32 convs
    run cuDNN's exact algorithms and a TF32 kernel's error is over twice theirs); never exact fp32 on
    FMA units, which never beat cuDNN. TMA configs are left out (within 9% of the pointer
    kernel, `_TMA_LAUNCHES`: not worth a compile each in tuning). Support order is left out: its
    scattered stores made every one of ResNet-50's 16 probed layers 1.5-14x slower than the same
    units stored contiguously (benchmarks/tensorcore_store_probe.py), so masks for this backend keep
    channel-run tiles."""
    launches = (_LAUNCHES[0] + (1,), _SMALL_GRID_LAUNCH)
    configs = [config for config in candidate_configs(spec, dtype)
               if (config.block_m, config.num_warps, config.num_stages, config.unroll) in launches
               and config.order == "index" and config.loads == "pointer"]
    if dtype == torch.float32:
        configs = [dataclasses.replace(config, precision=precision) for precision in ("tf32", "tf32x3")
                   for config in configs]
    return configs
