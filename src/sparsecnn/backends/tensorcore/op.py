"""The `sparsecnn::tensorcore_conv2d` op: the unit kernel (`kernel.py`) with its fused epilogue
act(conv + bias + residual), on the tensors of a `UnitWeights`; `tensorcore_shortcut_conv2d`: the
same with a 1x1 projection shortcut in its reduction (`format.pack_shortcut_units`). Its output is channels_last (NHWC),
the layout it reads, so that consecutive layers pass activations without copies. Conventions of
all ops: `core/op_support.py`.
"""
from __future__ import annotations

import functools
import json
from typing import List, Optional

import torch
from torch.library import custom_op, register_fake

from sparsecnn.core.op_support import fake_output


@functools.lru_cache(maxsize=None)
def _config(text: str):
    from sparsecnn.backends.tensorcore.kernel import TensorCoreConfig

    return TensorCoreConfig.from_dict(json.loads(text))


def tensorcore_conv2d_eager(x: torch.Tensor, values: torch.Tensor, unit_tap: torch.Tensor, unit_chunk: torch.Tensor,
                            unit_code: torch.Tensor, group_start: torch.Tensor, out_channel: torch.Tensor,
                            bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], kernel_shape: List[int],
                            stride: List[int], padding: List[int], permuted: bool, max_units: int, config: str,
                            relu: bool) -> torch.Tensor:
    """act(conv(x) + bias + residual) -> (N, K, P, Q) channels_last; see the module docstring."""
    from sparsecnn.backends.tensorcore.format import UnitWeights
    from sparsecnn.backends.tensorcore.kernel import unit_conv

    parsed = _config(config)
    packed = UnitWeights(values, unit_tap, unit_chunk, unit_code, group_start, out_channel, tuple(kernel_shape),
                         parsed.group, parsed.chunk, permuted, max_units=max_units)
    return unit_conv(x, packed, tuple(stride), tuple(padding), parsed, bias=bias, residual=residual, relu=relu)


tensorcore_conv2d = custom_op("sparsecnn::tensorcore_conv2d", tensorcore_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::tensorcore_conv2d")
def _tensorcore_conv2d_fake(x, values, unit_tap, unit_chunk, unit_code, group_start, out_channel, bias, residual,
                            kernel_shape, stride, padding, permuted, max_units, config, relu):
    return fake_output(x, residual, kernel_shape, stride, padding).contiguous(memory_format=torch.channels_last)


def tensorcore_shortcut_conv2d_eager(x: torch.Tensor, values: torch.Tensor, unit_tap: torch.Tensor,
                                     unit_chunk: torch.Tensor, unit_code: torch.Tensor, group_start: torch.Tensor,
                                     out_channel: torch.Tensor, group_split: torch.Tensor,
                                     bias: Optional[torch.Tensor], shortcut_input: torch.Tensor,
                                     kernel_shape: List[int], stride: List[int], padding: List[int],
                                     shortcut_channels: int, shortcut_stride: List[int], max_units: int, config: str,
                                     relu: bool) -> torch.Tensor:
    """act(conv(x) + bias + conv(shortcut_input, W2, shortcut_stride)) -> (N, K, P, Q) channels_last,
    on the tensors of `format.pack_shortcut_units` (index order)."""
    from sparsecnn.backends.tensorcore.format import UnitWeights
    from sparsecnn.backends.tensorcore.kernel import unit_conv

    parsed = _config(config)
    packed = UnitWeights(values, unit_tap, unit_chunk, unit_code, group_start, out_channel, tuple(kernel_shape),
                         parsed.group, parsed.chunk, False, max_units=max_units, shortcut_channels=shortcut_channels,
                         group_split=group_split)
    return unit_conv(x, packed, tuple(stride), tuple(padding), parsed, bias=bias, relu=relu,
                     shortcut=shortcut_input, shortcut_stride=tuple(shortcut_stride))


tensorcore_shortcut_conv2d = custom_op("sparsecnn::tensorcore_shortcut_conv2d", tensorcore_shortcut_conv2d_eager,
                                       mutates_args=())


@register_fake("sparsecnn::tensorcore_shortcut_conv2d")
def _tensorcore_shortcut_conv2d_fake(x, values, unit_tap, unit_chunk, unit_code, group_start, out_channel, group_split,
                                     bias, shortcut_input, kernel_shape, stride, padding, shortcut_channels,
                                     shortcut_stride, max_units, config, relu):
    return fake_output(x, None, kernel_shape, stride, padding).contiguous(memory_format=torch.channels_last)
