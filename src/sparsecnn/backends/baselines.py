"""The baselines every kernel is measured against: dense cuDNN, im2col + cuBLAS, im2col + cuSPARSE."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import CSRWeight
from ..layers import ConvSpec
from .registry import Backend, register_backend

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dense_run(x, weight, bias, spec: ConvSpec, config):
    return F.conv2d(x, weight, bias, spec.stride, spec.padding, spec.dilation, spec.groups)


def _unfold(x: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """(N, C, H, W) -> columns (N, C*R*S, P*Q)."""
    return F.unfold(x, (spec.R, spec.S), spec.dilation, spec.padding, spec.stride)


def _finish(y: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec) -> torch.Tensor:
    """(N, K, P*Q) -> (N, K, P, Q) plus bias."""
    y = y.reshape(spec.N, spec.K, spec.P, spec.Q)
    return y if bias is None else y + bias.view(1, -1, 1, 1)


def _gemm_run(x, weight_matrix, bias, spec: ConvSpec, config):
    return _finish(weight_matrix @ _unfold(x, spec), bias, spec)


def _spmm_run(x, csr, bias, spec: ConvSpec, config):
    cols = _unfold(x, spec).transpose(0, 1).reshape(csr.shape[1], -1)  # (CRS, N*P*Q)
    y = torch.sparse.mm(csr, cols).reshape(spec.K, spec.N, -1).transpose(0, 1)
    return _finish(y, bias, spec)


def _groups_one(spec: ConvSpec) -> Optional[str]:
    return None if spec.groups == 1 else f"groups={spec.groups} (only groups=1)"


DENSE = register_backend(Backend(
    name="dense",
    description="F.conv2d on the dense weight with zeros (cuDNN on CUDA)",
    dtypes={"cpu": (torch.float32, torch.bfloat16, torch.float64), "cuda": _FLOATS},
    prepare=lambda weight, config: weight,
    run=_dense_run,
))

IM2COL_CUBLAS = register_backend(Backend(
    name="im2col-cublas",
    description="F.unfold + dense GEMM (cuBLAS on CUDA)",
    dtypes={"cpu": (torch.float32, torch.float64), "cuda": _FLOATS},
    prepare=lambda weight, config: weight.reshape(weight.shape[0], -1).contiguous(),
    run=_gemm_run,
    spec_check=_groups_one,
))

IM2COL_CUSPARSE = register_backend(Backend(
    name="im2col-cusparse",
    description="F.unfold + CSR SpMM via torch.sparse.mm (cuSPARSE on CUDA)",
    dtypes={"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.float64)},
    prepare=lambda weight, config: CSRWeight.from_dense(weight).to_torch(),
    run=_spmm_run,
    spec_check=_groups_one,
))
