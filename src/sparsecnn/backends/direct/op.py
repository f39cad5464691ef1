"""The `sparsecnn::direct_conv2d` op: the direct kernel (`kernel.py`) with its fused epilogue
act(conv + bias + residual); the tensors of `kernel.weight_arrays` (codes: variant "batch" with
padding reads a batch-innermost x unpadded with them). Conventions of all ops: `core/op_support.py`.
"""
from __future__ import annotations

import functools
import json
from typing import List, Optional

import torch
from torch.library import custom_op, register_fake

from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.op_support import check_padded_hw, fake_output


@functools.lru_cache(maxsize=None)
def _direct_config(text: str):
    from sparsecnn.backends.direct.kernel import DirectConfig

    return DirectConfig.from_dict(json.loads(text))


def direct_conv2d_eager(x: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                        row_ptr: Optional[torch.Tensor], row_order: Optional[torch.Tensor],
                        codes: Optional[torch.Tensor], bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                        kernel_shape: List[int], padded_hw: List[int], stride: List[int], padding: List[int],
                        config: str, relu: bool) -> torch.Tensor:
    """act(direct sparse conv(x) + bias + residual) -> (N, K, P, Q); see the module docstring."""
    from sparsecnn.backends.direct.kernel import direct_conv2d_arrays

    check_padded_hw(x, padded_hw, padding)
    return direct_conv2d_arrays(x, values, offsets, row_ptr, row_order, codes, tuple(kernel_shape), bias,
                                tuple(stride), tuple(padding), _direct_config(config), relu=relu, residual=residual)


direct_conv2d = custom_op("sparsecnn::direct_conv2d", direct_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::direct_conv2d")
def _direct_conv2d_fake(x, values, offsets, row_ptr, row_order, codes, bias, residual, kernel_shape, padded_hw,
                        stride, padding, config, relu):
    contiguous = fake_output(x, residual, kernel_shape, stride, padding)
    return new_output(contiguous.shape, x, _direct_config(config).out_layout)
