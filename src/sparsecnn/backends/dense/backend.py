"""The dense cuDNN backends every kernel is measured against, and that tuning always offers.

dense is F.conv2d on the weight with zeros; dense-tf32 and dense-channels-last are the dense forms the
tuner also offers (precision policy "tf32"; fp16/bf16); dense-fused is dense cuDNN with the epilogue
fused into the convolution (op `sparsecnn::cudnn_fused_conv2d` in `op.py`: aten's
cudnn_convolution_relu has no fake implementation).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.nn.functional as F

from sparsecnn.backends.dense import op
from sparsecnn.core.registry import (
    Backend,
    KernelCall,
    apply_epilogue_,
    register_backend,
)
from sparsecnn.core.spec import ConvSpec

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dense_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                groups: int, relu: bool) -> torch.Tensor:
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return apply_epilogue_(y, relu, residual)


def _dense_bind(weight: torch.Tensor, spec: ConvSpec, config, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    return KernelCall(_dense_conv, (weight,), (list(spec.stride), list(spec.padding), list(spec.dilation),
                                               spec.groups))


DENSE = register_backend(Backend(
    name="dense",
    description="F.conv2d on the dense weight with zeros (cuDNN on CUDA)",
    dtypes={"cpu": (torch.float32, torch.bfloat16, torch.float64), "cuda": _FLOATS},
    prepare=lambda weight, config: weight,
    bind=_dense_bind,
))


def _dense_tf32_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     residual: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                     groups: int, relu: bool) -> torch.Tensor:
    """cuDNN convolution allowed to round fp32 products to TF32 whatever the global flag says: aten's
    `_convolution` takes allow_tf32 per call (so no global state changes, and it traces)."""
    cudnn = torch.backends.cudnn
    y = torch.ops.aten._convolution.default(x, weight, bias, stride, padding, dilation, False, [0, 0], groups,
                                            cudnn.benchmark, cudnn.deterministic, cudnn.enabled, True)
    return apply_epilogue_(y, relu, residual)


def _dense_tf32_bind(weight: torch.Tensor, spec: ConvSpec, config, dtype: torch.dtype,
                     has_bias: bool) -> KernelCall:
    return dataclasses.replace(_dense_bind(weight, spec, config, dtype, has_bias), fn=_dense_tf32_conv)


def _dense_channels_last_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              residual: Optional[torch.Tensor], stride: List[int], padding: List[int],
                              dilation: List[int], groups: int, relu: bool) -> torch.Tensor:
    """F.conv2d in NHWC (weight packed channels_last); the output stays channels_last, so that the
    next dense layers run in NHWC too (cuDNN follows the input's layout) and a model converts once,
    not at every layer. A Triton kernel after it reads NHWC through its input copy (padded layers
    make that copy anyway); the autotuner times each layer on the layout it really receives."""
    y = F.conv2d(x.contiguous(memory_format=torch.channels_last), weight, bias, stride, padding, dilation, groups)
    return apply_epilogue_(y, relu, residual)


def _dense_channels_last_bind(weight: torch.Tensor, spec: ConvSpec, config, dtype: torch.dtype,
                              has_bias: bool) -> KernelCall:
    return dataclasses.replace(_dense_bind(weight, spec, config, dtype, has_bias), fn=_dense_channels_last_conv)


DENSE_TF32 = register_backend(Backend(
    name="dense-tf32",
    description="F.conv2d with cuDNN allowed to round fp32 products to TF32 (tensor cores)",
    dtypes={"cuda": (torch.float32,)},
    prepare=lambda weight, config: weight,
    bind=_dense_tf32_bind,
))


DENSE_CHANNELS_LAST = register_backend(Backend(
    name="dense-channels-last",
    description="F.conv2d in channels_last (NHWC: cuDNN's tensor-core layout for fp16/bf16), output "
                "channels_last",
    dtypes={"cuda": (torch.float16, torch.bfloat16)},
    prepare=lambda weight, config: weight.contiguous(memory_format=torch.channels_last),
    bind=_dense_channels_last_bind,
))


def _fused_channels_last(dtype: torch.dtype) -> bool:
    """NHWC for fp16/bf16 (cuDNN's tensor-core layout), NCHW for fp32."""
    return dtype in (torch.float16, torch.bfloat16)


def _dense_fused_prepare(weight: torch.Tensor, config) -> torch.Tensor:
    layout = torch.channels_last if _fused_channels_last(weight.dtype) else torch.contiguous_format
    return weight.contiguous(memory_format=layout)


def _dense_fused_bind(weight: torch.Tensor, spec: ConvSpec, config, dtype: torch.dtype,
                      has_bias: bool) -> KernelCall:
    static = (list(spec.stride), list(spec.padding), list(spec.dilation), spec.groups, _fused_channels_last(dtype))
    return KernelCall(torch.ops.sparsecnn.cudnn_fused_conv2d.default, (weight,), static,
                      eager=op.cudnn_fused_conv2d_eager)


DENSE_FUSED = register_backend(Backend(
    name="dense-fused",
    description="cuDNN conv + bias (+ residual) + ReLU as one fusion graph (fp16/bf16 NHWC, fp32 NCHW); "
                "layers without ReLU run F.conv2d then the residual add",
    dtypes={"cuda": (torch.float32, torch.float16, torch.bfloat16)},
    prepare=_dense_fused_prepare,
    bind=_dense_fused_bind,
))
