"""Max pooling for sparsified models: `MaxPool2d` and the functional `max_pool2d`.

`prepare_for_inference` swaps every nn.MaxPool2d and F.max_pool2d call without indices for these.
Eager on CUDA (and under CUDA-graph capture) they launch core/max_pool.py (no argmax, the
input's layout kept); under torch.compile and off CUDA they are F.max_pool2d, which inductor
lowers without indices and fuses with its neighbours: as an opaque op our kernel made the compiled
fp16 GoogLeNet slower than F.max_pool2d, since inductor then writes each
inception concatenation out before pooling it. The values are F.max_pool2d's either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.core.pool_args import POOL_DTYPES, PoolArgs


def _runs_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 4 and x.dtype in POOL_DTYPES and not torch.compiler.is_compiling()


def _pooled(x: torch.Tensor, args: PoolArgs) -> torch.Tensor:
    from sparsecnn.core.max_pool import max_pool2d as launch_max_pool2d
    return launch_max_pool2d(x, args)


def max_pool2d(input: torch.Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> torch.Tensor:
    """F.max_pool2d, by our kernel on CUDA 4-D inputs outside torch.compile when no indices are asked for."""
    if return_indices or not _runs_kernel(input):
        return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                            return_indices=return_indices)
    return _pooled(input, PoolArgs.of(kernel_size, stride, padding, dilation, ceil_mode))


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (without indices) that runs our kernel on CUDA 4-D inputs outside torch.compile:
    no argmax written, and the output keeps the input's memory layout. Otherwise nn.MaxPool2d."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False):
        super().__init__(kernel_size, stride, padding, dilation, return_indices=False, ceil_mode=ceil_mode)
        self.args = PoolArgs.of(kernel_size, stride, padding, dilation, ceil_mode)

    @classmethod
    def from_module(cls, pool: nn.MaxPool2d) -> "MaxPool2d":
        if pool.return_indices:
            raise ValueError("a MaxPool2d with return_indices=True cannot be swapped: "
                             "our pool kernel computes no indices")
        return cls(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _pooled(x, self.args) if _runs_kernel(x) else super().forward(x)
