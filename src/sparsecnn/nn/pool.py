"""Max pooling for sparsified models: `MaxPool2d` and the functional `max_pool2d`.

`prepare_for_inference` swaps every nn.MaxPool2d and F.max_pool2d call without indices for these.
On CUDA they run the `sparsecnn::max_pool2d` op (no argmax, input layout kept: see
kernels/triton/pool.py), elsewhere F.max_pool2d; the values are F.max_pool2d's either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..kernels.pool import POOL_DTYPES, PoolArgs


def _runs_op(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 4 and x.dtype in POOL_DTYPES


def _pooled(x: torch.Tensor, args: PoolArgs) -> torch.Tensor:
    """The op under torch.compile; eagerly its kernel's launcher, skipping the dispatcher and the
    op's argument parsing (Python time that eager runs, CPU-bound, pay per call)."""
    if torch.compiler.is_compiling():
        return ops.max_pool2d(x, list(args.kernel_size), list(args.stride), list(args.padding), list(args.dilation),
                              args.ceil_mode)
    from ..kernels.triton.pool import max_pool2d as launch_max_pool2d
    return launch_max_pool2d(x, args)


def max_pool2d(input: torch.Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> torch.Tensor:
    """F.max_pool2d with the op on CUDA 4-D inputs; with return_indices, F.max_pool2d itself."""
    if return_indices or not _runs_op(input):
        return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                            return_indices=return_indices)
    return _pooled(input, PoolArgs.of(kernel_size, stride, padding, dilation, ceil_mode))


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (without indices) that runs the op on CUDA 4-D inputs: no argmax written, and
    the output keeps the input's memory layout. Other inputs go to nn.MaxPool2d."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False):
        super().__init__(kernel_size, stride, padding, dilation, return_indices=False, ceil_mode=ceil_mode)
        self.args = PoolArgs.of(kernel_size, stride, padding, dilation, ceil_mode)

    @classmethod
    def from_module(cls, pool: nn.MaxPool2d) -> "MaxPool2d":
        if pool.return_indices:
            raise ValueError("a MaxPool2d with return_indices=True cannot be swapped: the op computes no indices")
        return cls(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _pooled(x, self.args) if _runs_op(x) else super().forward(x)
