"""Backends `im2col-cublas` (F.unfold + dense GEMM) and `im2col-cusparse` (F.unfold + CSR SpMM):
the baselines of the papers. im2col-cublas is an aten composition; im2col-cusparse runs through the op
`sparsecnn::im2col_csr_conv2d` (`op.py`), because torch.compile cannot trace sparse tensors. Neither has
a fused epilogue: each ends with `apply_epilogue_`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from sparsecnn.backends.im2col import op
from sparsecnn.core.csr import CSRWeight
from sparsecnn.core.registry import (
    Backend,
    KernelCall,
    apply_epilogue_,
    register_backend,
)
from sparsecnn.core.spec import ConvSpec

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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
    """`_spmm_conv` without the dispatcher (see core/op_support.py: its first dispatch imports torch._dynamo)."""
    y = op.im2col_csr_conv2d_eager(x, crow_indices, col_indices, values, bias, kernel_shape, stride, padding,
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


IM2COL_CUBLAS = register_backend(Backend(
    name="im2col-cublas",
    description="F.unfold + dense GEMM (cuBLAS on CUDA)",
    dtypes={"cpu": (torch.float32, torch.float64), "cuda": _FLOATS},
    prepare=lambda weight, config: weight.reshape(weight.shape[0], -1).contiguous(),
    bind=_gemm_bind,
    spec_check=_groups_one,
    # On CUDA it won no layer in the recorded GPU tunings (RESULTS.md, "Cold tuning time") while each
    # layer paid its first call (a large im2col buffer) and probe: `auto` tries it on the CPU only;
    # name it in `backends=` to time it on CUDA.
    autotune_devices=("cpu",),
))


IM2COL_CUSPARSE = register_backend(Backend(
    name="im2col-cusparse",
    description="F.unfold + CSR SpMM via torch.sparse.mm (cuSPARSE on CUDA)",
    dtypes={"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.float64)},
    prepare=_csr_arrays,
    bind=_spmm_bind,
    spec_check=_groups_one,
    # On CUDA it never won a layer (several times slower than dense cuDNN), so
    # `auto` tries it on the CPU only; name it in `backends=` to time it on CUDA.
    autotune_devices=("cpu",),
))
