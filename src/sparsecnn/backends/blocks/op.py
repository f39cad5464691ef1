"""The `sparsecnn::blocks_conv2d` op: the blocks kernel (`kernel.py`), epilogue fused;
the tensors of `kernel.weight_arrays`. Conventions of all ops: `core/op_support.py`.
"""
from __future__ import annotations

import functools
import json
from typing import List, Optional

import torch
from torch.library import custom_op, register_fake

from sparsecnn.core.op_support import check_padded_hw, fake_output


@functools.lru_cache(maxsize=None)
def _blocks_config(text: str):
    from sparsecnn.backends.blocks.kernel import BlocksConfig

    return BlocksConfig.from_dict(json.loads(text))


def blocks_conv2d_eager(x: torch.Tensor, rows: torch.Tensor, dense_start: torch.Tensor,
                        dense_offsets: torch.Tensor, dense_values: torch.Tensor, ell_start: torch.Tensor,
                        ell_offsets: torch.Tensor, ell_values: torch.Tensor, bias: Optional[torch.Tensor],
                        residual: Optional[torch.Tensor], kernel_shape: List[int], padded_hw: List[int],
                        stride: List[int], padding: List[int], config: str, relu: bool) -> torch.Tensor:
    """act(blocks sparse conv(x) + bias + residual) -> (N, K, P, Q); see the module docstring."""
    from sparsecnn.backends.blocks.kernel import blocks_conv2d_arrays

    check_padded_hw(x, padded_hw, padding)
    arrays = (rows, dense_start, dense_offsets, dense_values, ell_start, ell_offsets, ell_values)
    return blocks_conv2d_arrays(x, arrays, tuple(kernel_shape), bias, tuple(stride), tuple(padding),
                                _blocks_config(config), relu=relu, residual=residual)


blocks_conv2d = custom_op("sparsecnn::blocks_conv2d", blocks_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::blocks_conv2d")
def _blocks_conv2d_fake(x, rows, dense_start, dense_offsets, dense_values, ell_start, ell_offsets, ell_values, bias,
                        residual, kernel_shape, padded_hw, stride, padding, config, relu):
    return fake_output(x, residual, kernel_shape, stride, padding)
