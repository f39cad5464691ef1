"""The `sparsecnn::unrolled_conv2d` op: a compiled unrolled kernel (one layer's weights as FMA
immediates, PTX through ptxas, fp32 or fp16: x, bias, residual and output all of the kernel's dtype)
found by its handle, with the fused epilogue; its output is batch-innermost when the config's
out_layout says so.
"""
from __future__ import annotations

import functools
import json
from typing import Optional

import torch
from torch.library import custom_op, register_fake

from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.checks import check_residual
from sparsecnn.core.op_support import codegen_kernel


@functools.lru_cache(maxsize=None)
def _unrolled_config(text: str):
    from sparsecnn.backends.unrolled.kernel import UnrolledConfig

    return UnrolledConfig.from_dict(json.loads(text))


def _unrolled_kernel(x: torch.Tensor, handle: int):
    compiled = codegen_kernel(handle)
    if tuple(x.shape) != compiled.spec.input_shape:
        raise ValueError(f"unrolled kernel {handle} is compiled for {compiled.spec.input_shape} inputs, got "
                         f"{tuple(x.shape)}")
    return compiled


def unrolled_conv2d_eager(x: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], handle: int,
                          config: str, relu: bool) -> torch.Tensor:
    """act(conv(x) + bias + residual) by the unrolled kernel registered under `handle` -> (N, K, P, Q)."""
    from sparsecnn.backends.unrolled.kernel import unrolled_conv2d as launch

    return launch(x, _unrolled_kernel(x, handle), bias, residual, relu, _unrolled_config(config))


unrolled_conv2d = custom_op("sparsecnn::unrolled_conv2d", unrolled_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::unrolled_conv2d")
def _unrolled_conv2d_fake(x, bias, residual, handle, config, relu):
    compiled = _unrolled_kernel(x, handle)
    check_residual(residual, compiled.spec.output_shape, x)
    return new_output(compiled.spec.output_shape, x, _unrolled_config(config).out_layout)
