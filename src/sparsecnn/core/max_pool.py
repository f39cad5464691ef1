"""Max pooling for inference: no indices, the input's memory layout kept.

Why. PyTorch's CUDA max pooling always computes the argmax: it writes an int64 index beside every
output value, reads NCHW through a kernel of one thread per output with 64-bit index arithmetic,
and copies any input that is neither NCHW nor channels_last (a batch-innermost activation of
`direct` "batch" layers) to NCHW first: a sizeable share of a sparsified GoogLeNet's forward.
Here one program writes BLOCK
consecutive outputs of one plane of the two innermost dims in memory order (coalesced stores), the
outer two dims' coordinates computed once per program and the inner size a constexpr (so the
per-output div/mod is a multiply and shift), and reads each window's taps, which are contiguous
along the layout's innermost dim (w for NCHW, n batch-innermost, c channels_last), with 32-bit
index arithmetic unless the tensors are too large for it. It is faster than F.max_pool2d on the
pools of GoogLeNet and VGG16, fp32 and fp16. Tried and slower: one program per block of all
outputs in memory order with a runtime div/mod chain per output (the integer work bound it in
fp16); 2-D tiles (rows of the outer dims x a block of the innermost dim).

Semantics are F.max_pool2d's (bitwise: a max involves no rounding): -inf padding, ceil_mode,
dilation, and a NaN anywhere in a window makes the output NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import triton
import triton.language as tl

from sparsecnn.core.checks import check_pow2_field, check_triton_input
from sparsecnn.core.pool_args import POOL_DTYPES, PoolArgs, dense_order, empty_in_order
from sparsecnn.core.triton_launch import launch


@dataclass(frozen=True)
class PoolConfig:
    """block: outputs per program (the next power of two above a smaller plane's size, with at most
    block / 32 warps); num_warps: warps per program."""

    block: int = 512
    num_warps: int = 4

    def __post_init__(self):
        check_pow2_field("PoolConfig", "block", self.block, 128, 4096)
        check_pow2_field("PoolConfig", "num_warps", self.num_warps, 1, 8)
        if self.block < 32 * self.num_warps:
            raise ValueError(f"PoolConfig.block ({self.block}) must be at least 32 * num_warps ({32 * self.num_warps})")


# The first is the default: summed over every pool of googlenet, vgg16, resnet50 and alexnet-cifar
# it was the fastest or close to it in each of fp32 NCHW, fp32 batch-innermost, fp16 channels_last
# and fp16 batch-innermost.
CONFIGS = (PoolConfig(512, 4), PoolConfig(256, 2), PoolConfig(1024, 4), PoolConfig(2048, 8))
DEFAULT = CONFIGS[0]


@triton.jit
def _pick(c0, c1, c2, c3, POS: tl.constexpr):
    if POS == 0:
        return c0
    elif POS == 1:
        return c1
    elif POS == 2:
        return c2
    else:
        return c3


@triton.jit(do_not_specialize=["O1", "O2", "XS0", "XS1", "XS2", "XS3", "XSH", "H", "W",
                               "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w"])
def _max_pool2d_kernel(x_ptr, y_ptr, O1, O2, XS0, XS1, XS2, XS3, XSH, XSW, H, W,
                       stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, O3: tl.constexpr,
                       KH: tl.constexpr, KW: tl.constexpr, HPOS: tl.constexpr, WPOS: tl.constexpr,
                       WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """y[o] = max over the KH x KW window of output o, o in y's memory order.

    The output's dims in memory order (outermost first) have sizes (O0, O1, O2, O3); HPOS and
    WPOS say which of them are P and Q. Program (i, j): outer index i over (O0, O1), outputs
    j * BLOCK .. of the inner O2 x O3 plane. XS0..XS3: x's strides of those dims, 0 for P and Q;
    XSH, XSW: x's strides along H and W. WIDE: int64 offsets.
    """
    outer = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if WIDE:
        outer = outer.to(tl.int64)
        idx = idx.to(tl.int64)
    c0 = outer // O1
    c1 = outer % O1
    live = idx < O2 * O3
    c2 = idx // O3  # O3 is a constexpr: a multiply and a shift, not a division
    c3 = idx % O3
    base = x_ptr + (c0 * XS0 + c1 * XS1 + c2 * XS2 + c3 * XS3)
    top = _pick(c0, c1, c2, c3, HPOS) * stride_h - pad_h
    left = _pick(c0, c1, c2, c3, WPOS) * stride_w - pad_w
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for r in tl.static_range(KH):
        ih = top + r * dil_h
        row_ok = live & (ih >= 0) & (ih < H)
        for s in tl.static_range(KW):
            iw = left + s * dil_w
            value = tl.load(base + ih * XSH + iw * XSW, mask=row_ok & (iw >= 0) & (iw < W),
                            other=float("-inf")).to(tl.float32)
            best = tl.where((value > best) | (value != value), value, best)  # NaN wins, as in torch
    tl.store(y_ptr + (outer * (O2 * O3) + idx), best.to(y_ptr.dtype.element_ty), mask=live)


_MAX_GRID_Y = 65535


class BoundPool:
    """The launch of one pool for one input shape, layout and dtype: everything but the tensors,
    computed once (an eager call then costs an allocation and a launch)."""

    def __init__(self, x: torch.Tensor, args: PoolArgs, config: PoolConfig):
        n, c, h, w = x.shape
        self.order = dense_order(x)
        self.contiguous = self.order == (0, 1, 2, 3) and not x.is_contiguous()
        strides = (c * h * w, h * w, w, 1) if self.contiguous else x.stride()
        self.shape = (n, c, *args.output_hw(h, w))
        sizes = [self.shape[dim] for dim in self.order]
        x_strides = [0 if dim in (2, 3) else strides[dim] for dim in self.order]
        numel = n * c * self.shape[2] * self.shape[3]
        wide = max(numel, x.numel()) >= 2 ** 31 - config.block
        # A plane smaller than the block (GoogLeNet's 7x7 and 14x14 NCHW pools) gets a smaller
        # program, else most of its lanes would idle.
        block = min(config.block, max(32, triton.next_power_of_2(sizes[2] * sizes[3])))
        num_warps = min(config.num_warps, block // 32)
        self.grid = (sizes[0] * sizes[1], triton.cdiv(sizes[2] * sizes[3], block))
        if self.grid[1] > _MAX_GRID_Y:
            raise ValueError(f"max pool output planes of {sizes[2]} x {sizes[3]} need {self.grid[1]} programs along "
                             f"CUDA's grid y (at most {_MAX_GRID_Y}): the kernel does not take an image this large")
        self.scalars = (sizes[1], sizes[2], *x_strides, strides[2], strides[3], h, w,
                        *args.stride, *args.padding, *args.dilation)
        self.meta = dict(O3=sizes[3], KH=args.kernel_size[0], KW=args.kernel_size[1], HPOS=self.order.index(2),
                         WPOS=self.order.index(3), WIDE=wide, BLOCK=block, num_warps=num_warps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.contiguous:
            x = x.contiguous()
        y = empty_in_order(self.shape, self.order, x)
        if y.numel():
            launch(_max_pool2d_kernel, self.grid, (x, y, *self.scalars), **self.meta)
        return y


_BOUND: Dict[Tuple, BoundPool] = {}


def max_pool2d(x: torch.Tensor, args: PoolArgs, config: PoolConfig = DEFAULT) -> torch.Tensor:
    """F.max_pool2d(x, ...) -> (N, C, P, Q) in x's memory layout (NCHW if x is not dense in any).

    x: (N, C, H, W) float32, float16 or bfloat16, on CUDA (or on the CPU under TRITON_INTERPRET=1).
    """
    check_triton_input(x, "max pool", POOL_DTYPES)
    key = (x.shape, x.stride(), x.dtype, x.device, args, config)
    bound = _BOUND.get(key)
    if bound is None:
        bound = _BOUND.setdefault(key, BoundPool(x, args, config))
    return bound(x)
