"""The `sparsecnn::codegen_conv2d` op: a compiled codegen kernel set (cubins launched through
cuda-python or CuPy), conv + bias only, found by its process-local handle (`core/op_support.py`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op, register_fake

from sparsecnn.core.op_support import codegen_kernel


def _codegen_output(x: torch.Tensor, handle: int):
    spec = codegen_kernel(handle).plan.spec
    if x.dim() != 4 or tuple(x.shape[1:]) != (spec.C, spec.H, spec.W):
        raise ValueError(f"codegen kernel {handle} is compiled for (N, {spec.C}, {spec.H}, {spec.W}) inputs, "
                         f"got {tuple(x.shape)}")
    return (x.shape[0], spec.K, spec.P, spec.Q)


def codegen_conv2d_eager(x: torch.Tensor, bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    """conv(x) + bias by the codegen kernels registered under `handle` -> (N, K, P, Q)."""
    _codegen_output(x, handle)
    return codegen_kernel(handle)(x, bias)


codegen_conv2d = custom_op("sparsecnn::codegen_conv2d", codegen_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::codegen_conv2d")
def _codegen_conv2d_fake(x, bias, handle):
    return x.new_empty(_codegen_output(x, handle))
