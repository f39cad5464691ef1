"""The baselines every kernel is measured against: dense cuDNN, im2col + cuBLAS, im2col + cuSPARSE.

dense and im2col-cublas are aten compositions (torch.compile traces them as they are);
im2col-cusparse runs through the op `sparsecnn::im2col_csr_conv2d`, because torch.compile cannot
trace sparse tensors. None has a fused epilogue: each ends with `apply_epilogue_`.
dense-tf32 and dense-channels-last are the dense forms the autotuner also offers (precision policy
"tf32"; fp16/bf16); dense-fused is dense cuDNN with the epilogue fused into the convolution (op
`sparsecnn::cudnn_fused_conv2d`: aten's cudnn_convolution_relu has no fake implementation).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import ops
from ..formats import CSRWeight
from ..layers import ConvSpec
from .registry import Backend, KernelCall, apply_epilogue_, register_backend

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dense_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                groups: int, relu: bool) -> torch.Tensor:
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return apply_epilogue_(y, relu, residual)


def _dense_bind(weight: torch.Tensor, spec: ConvSpec, config, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    return KernelCall(_dense_conv, (weight,), (list(spec.stride), list(spec.padding), list(spec.dilation),
                                               spec.groups))


def _gemm_conv(x: torch.Tensor, weight_matrix: torch.Tensor, bias: Optional[torch.Tensor],
               residual: Optional[torch.Tensor], kernel_size: List[int], stride: List[int], padding: List[int],
               dilation: List[int], output_kpq: Sequence[int], relu: bool) -> torch.Tensor:
    """(K, C*R*S) weight @ unfolded x (N, C*R*S, P*Q) -> (N, K, P, Q), then bias and epilogue."""
    cols = F.unfold(x, kernel_size, dilation, padding, stride)
    y = (weight_matrix @ cols).reshape(x.shape[0], *output_kpq)
    if bias is not None:
        y = y + bias.view(1, -1, 1, 1)
    return apply_epilogue_(y, relu, residual)


def _gemm_bind(weight_matrix: torch.Tensor, spec: ConvSpec, config, dtype: torch.dtype,
               has_bias: bool) -> KernelCall:
    return KernelCall(_gemm_conv, (weight_matrix,), ([spec.R, spec.S], list(spec.stride), list(spec.padding),
                                                     list(spec.dilation), [spec.K, spec.P, spec.Q]))


def _spmm_conv(x: torch.Tensor, crow_indices: torch.Tensor, col_indices: torch.Tensor, values: torch.Tensor,
               bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], kernel_shape: List[int],
               stride: List[int], padding: List[int], dilation: List[int], relu: bool) -> torch.Tensor:
    y = torch.ops.sparsecnn.im2col_csr_conv2d.default(x, crow_indices, col_indices, values, bias, kernel_shape,
                                                       stride, padding, dilation)
    return apply_epilogue_(y, relu, residual)


def _spmm_conv_eager(x: torch.Tensor, crow_indices: torch.Tensor, col_indices: torch.Tensor, values: torch.Tensor,
                     bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], kernel_shape: List[int],
                     stride: List[int], padding: List[int], dilation: List[int], relu: bool) -> torch.Tensor:
    """`_spmm_conv` without the dispatcher (see ops.py: its first dispatch imports torch._dynamo)."""
    y = ops.im2col_csr_conv2d_eager(x, crow_indices, col_indices, values, bias, kernel_shape, stride, padding,
                                    dilation)
    return apply_epilogue_(y, relu, residual)


def _csr_arrays(weight: torch.Tensor, config) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(crow_indices int64 (K + 1,), col_indices int64 (nnz,), values (nnz,)) of the K x C*R*S matrix:
    the arrays of a torch sparse CSR tensor, kept apart so that torch.compile can trace them."""
    csr = CSRWeight.from_dense(weight)
    return csr.row_ptr.long(), csr.col_idx.long(), csr.values


def _spmm_bind(arrays, spec: ConvSpec, config, dtype: torch.dtype, has_bias: bool) -> KernelCall:
    kernel_shape = [spec.K, spec.C, spec.R, spec.S]
    return KernelCall(_spmm_conv, tuple(arrays), (kernel_shape, list(spec.stride), list(spec.padding),
                                                  list(spec.dilation)), eager=_spmm_conv_eager)


def _groups_one(spec: ConvSpec) -> Optional[str]:
    return None if spec.groups == 1 else f"groups={spec.groups} (only groups=1)"


DENSE = register_backend(Backend(
    name="dense",
    description="F.conv2d on the dense weight with zeros (cuDNN on CUDA)",
    dtypes={"cpu": (torch.float32, torch.bfloat16, torch.float64), "cuda": _FLOATS},
    prepare=lambda weight, config: weight,
    bind=_dense_bind,
))

IM2COL_CUBLAS = register_backend(Backend(
    name="im2col-cublas",
    description="F.unfold + dense GEMM (cuBLAS on CUDA)",
    dtypes={"cpu": (torch.float32, torch.float64), "cuda": _FLOATS},
    prepare=lambda weight, config: weight.reshape(weight.shape[0], -1).contiguous(),
    bind=_gemm_bind,
    spec_check=_groups_one,
))

IM2COL_CUSPARSE = register_backend(Backend(
    name="im2col-cusparse",
    description="F.unfold + CSR SpMM via torch.sparse.mm (cuSPARSE on CUDA)",
    dtypes={"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.float64)},
    prepare=_csr_arrays,
    bind=_spmm_bind,
    spec_check=_groups_one,
    # On the H100/H200 it never won a layer (benchmarks/results: 2-4x slower than dense cuDNN), so
    # `auto` tries it on the CPU only; name it in `backends=` to time it on CUDA.
    autotune_devices=("cpu",),
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
                      eager=ops.cudnn_fused_conv2d_eager)


DENSE_FUSED = register_backend(Backend(
    name="dense-fused",
    description="cuDNN conv + bias (+ residual) + ReLU as one fusion graph (fp16/bf16 NHWC, fp32 NCHW); "
                "layers without ReLU run F.conv2d then the residual add",
    dtypes={"cuda": (torch.float32, torch.float16, torch.bfloat16)},
    prepare=_dense_fused_prepare,
    bind=_dense_fused_bind,
))
