"""The `sparsecnn::staged_conv2d` op: the staged-input kernel (`kernel.py`: CUDA C compiled per
geometry and config, fp32, N a multiple of 32), epilogue fused; `kernel.weight_arrays`. Its output is
batch-innermost when the config's out_layout says so; pool 2: a 2x2 stride-2 max pool of
act(conv + bias) in the epilogue, output (N, K, P // 2, Q // 2) (no residual).
"""
from __future__ import annotations

import functools
import json
from typing import List, Optional

import torch
from torch.library import custom_op, register_fake

from sparsecnn.core.batch_inner import new_output
from sparsecnn.core.op_support import fake_output


@functools.lru_cache(maxsize=None)
def _staged_config(text: str):
    from sparsecnn.backends.staged.kernel import StagedConfig

    return StagedConfig.from_dict(json.loads(text))


def staged_conv2d_eager(x: torch.Tensor, entries: torch.Tensor, chunk_ptr: torch.Tensor, channel: torch.Tensor,
                        bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], kernel_shape: List[int],
                        max_segment: int, stride: List[int], padding: List[int], config: str, pool: int,
                        relu: bool) -> torch.Tensor:
    """act(staged sparse conv(x) + bias + residual) -> (N, K, P, Q), pooled with pool 2; see the module
    docstring."""
    from sparsecnn.backends.staged.kernel import staged_conv2d_arrays

    return staged_conv2d_arrays(x, entries, chunk_ptr, channel, tuple(kernel_shape), max_segment, bias, residual,
                                tuple(stride), tuple(padding), _staged_config(config), relu, pool=pool)


staged_conv2d = custom_op("sparsecnn::staged_conv2d", staged_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::staged_conv2d")
def _staged_conv2d_fake(x, entries, chunk_ptr, channel, bias, residual, kernel_shape, max_segment, stride, padding,
                        config, pool, relu):
    from sparsecnn.backends.staged.kernel import pooled_shape

    contiguous = fake_output(x, residual, kernel_shape, stride, padding)
    return new_output(pooled_shape(contiguous.shape, pool), x, _staged_config(config).out_layout)
