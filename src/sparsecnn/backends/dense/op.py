"""The `sparsecnn::cudnn_fused_conv2d` op: dense cuDNN with the epilogue fused (aten's
cudnn_convolution_relu / cudnn_convolution_add_relu, which have no fake implementation of their own);
its output is channels_last when `channels_last`, else contiguous.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.library import custom_op, register_fake

from sparsecnn.core.checks import check_residual
from sparsecnn.core.op_support import fake_output, output_shape


def _memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def cudnn_fused_conv2d_eager(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             residual: Optional[torch.Tensor], stride: List[int], padding: List[int],
                             dilation: List[int], groups: int, channels_last: bool, relu: bool) -> torch.Tensor:
    """act(conv(x) + bias + residual) -> (N, K, P, Q), channels_last (NHWC) iff `channels_last`.

    x (N, C, H, W) any layout (converted to the output's); weight (K, C // groups, R, S) in that
    layout; bias (K,) or None; residual None or of the output's shape, dtype and device. With relu
    on CUDA the conv, bias, residual add and ReLU are one cuDNN fusion graph, instead of a conv and
    up to three passes over its output; without relu (cuDNN fuses no epilogue without an
    activation) and on CPU, F.conv2d then the epilogue.
    """
    layout = _memory_format(channels_last)
    x = x.contiguous(memory_format=layout)
    check_residual(residual, output_shape(x, weight.shape, stride, padding, dilation), x)
    if relu and x.is_cuda:
        if residual is None:
            y = torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
        else:
            y = torch.cudnn_convolution_add_relu(x, weight, residual.contiguous(memory_format=layout), 1.0, bias,
                                                 stride, padding, dilation, groups)
        return y.contiguous(memory_format=layout)
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups).contiguous(memory_format=layout)
    if residual is not None:
        y = y.add_(residual)
    return y.relu_() if relu else y


cudnn_fused_conv2d = custom_op("sparsecnn::cudnn_fused_conv2d", cudnn_fused_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::cudnn_fused_conv2d")
def _cudnn_fused_conv2d_fake(x, weight, bias, residual, stride, padding, dilation, groups, channels_last, relu):
    return fake_output(x, residual, weight.shape, stride, padding, dilation).contiguous(
        memory_format=_memory_format(channels_last))
