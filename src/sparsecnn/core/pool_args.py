"""Max pooling arguments and output layout, for the Triton pool kernel and `nn.pool`.

Imports neither triton nor CUDA (`nn.pool` checks its arguments at `import sparsecnn` time).
A pooled output keeps its input's memory layout: NCHW stays NCHW, channels_last stays
channels_last, and the batch-innermost (C, H, W, N) layout of `direct` "batch" layers stays
batch-innermost, so the layer after a pool reads its input where the pool wrote it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from sparsecnn.core.checks import int_pair

POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PoolArgs:
    """nn.MaxPool2d's arguments as pairs, checked as torch checks them (every error names the argument)."""

    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    ceil_mode: bool

    @classmethod
    def of(cls, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False) -> "PoolArgs":
        """stride None or () means stride = kernel_size, as in F.max_pool2d."""
        kernel = int_pair(kernel_size, "kernel_size")
        stride = kernel if stride is None or stride == () or stride == [] else int_pair(stride, "stride")
        return cls(kernel, stride, int_pair(padding, "padding"), int_pair(dilation, "dilation"), bool(ceil_mode))

    def __post_init__(self):
        for name in ("kernel_size", "stride", "dilation"):
            if min(getattr(self, name)) < 1:
                raise ValueError(f"max pool {name} must be >= 1, got {getattr(self, name)}")
        if min(self.padding) < 0 or any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"max pool padding must be >= 0 and at most half the kernel size "
                             f"{self.kernel_size}, got {self.padding}")

    def output_hw(self, height: int, width: int) -> Tuple[int, int]:
        """(P, Q) of an H x W input, torch's formula (ceil_mode: a last window may start in the
        right padding only if it starts inside the input or the left padding)."""
        sizes = []
        for size, k, s, p, d in zip((height, width), self.kernel_size, self.stride, self.padding, self.dilation):
            span = size + 2 * p - d * (k - 1) - 1
            out = (span + (s - 1 if self.ceil_mode else 0)) // s + 1
            if self.ceil_mode and (out - 1) * s >= size + p:
                out -= 1
            sizes.append(out)
        if min(sizes) < 1:
            raise ValueError(f"max pool output of a {height}x{width} input would be {sizes[0]}x{sizes[1]}: "
                             f"the input is too small for kernel_size {self.kernel_size}, dilation "
                             f"{self.dilation} and padding {self.padding}")
        return sizes[0], sizes[1]


def memory_order(x: torch.Tensor) -> Tuple[int, int, int, int]:
    """x's dims from outermost to innermost in memory (ties, e.g. size-1 dims, in logical order);
    x.permute(order) is contiguous when x is dense in some permutation of its dims."""
    return tuple(sorted(range(4), key=lambda dim: (-x.stride(dim), dim)))


def dense_order(x: torch.Tensor) -> Tuple[int, int, int, int]:
    """`memory_order(x)` if x is dense in that order, else NCHW's (0, 1, 2, 3) (x must be copied)."""
    order = memory_order(x)
    return order if x.permute(order).is_contiguous() else (0, 1, 2, 3)


def empty_in_order(shape, order, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of logical `shape`, dense with its dims laid out in `order`."""
    return torch.empty_permuted(tuple(shape), order, dtype=like.dtype, device=like.device)

