"""The `sparsecnn::im2col_csr_conv2d` op: the im2col + cuSPARSE baseline. torch.compile cannot
trace sparse tensors, so the CSR weight travels as its three arrays and the op rebuilds it.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.library import custom_op, register_fake

from sparsecnn.core.op_support import fake_output, output_shape


def im2col_csr_conv2d_eager(x: torch.Tensor, crow_indices: torch.Tensor, col_indices: torch.Tensor,
                            values: torch.Tensor, bias: Optional[torch.Tensor], kernel_shape: List[int],
                            stride: List[int], padding: List[int], dilation: List[int]) -> torch.Tensor:
    """conv(x) + bias as CSR (K x C*R*S, the three arrays of a torch sparse CSR tensor) times the
    unfolded input (torch.sparse.mm: cuSPARSE on CUDA) -> (N, K, P, Q). groups = 1."""
    k, c, r, s = kernel_shape
    if x.dim() != 4 or x.shape[1] != c:
        raise ValueError(f"x must be (N, {c}, H, W), got {tuple(x.shape)}")
    n, _, p, q = output_shape(x, kernel_shape, stride, padding, dilation)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # torch's beta-state notice
        weight = torch.sparse_csr_tensor(crow_indices, col_indices, values, (k, c * r * s), check_invariants=False)
    cols = F.unfold(x, (r, s), tuple(dilation), tuple(padding), tuple(stride))  # (N, CRS, PQ)
    y = torch.sparse.mm(weight, cols.transpose(0, 1).reshape(c * r * s, n * p * q))
    y = y.reshape(k, n, p, q).transpose(0, 1)
    return (y if bias is None else y + bias.view(1, -1, 1, 1)).contiguous()


im2col_csr_conv2d = custom_op("sparsecnn::im2col_csr_conv2d", im2col_csr_conv2d_eager, mutates_args=())


@register_fake("sparsecnn::im2col_csr_conv2d")
def _im2col_csr_conv2d_fake(x, crow_indices, col_indices, values, bias, kernel_shape, stride, padding, dilation):
    return fake_output(x, None, kernel_shape, stride, padding, dilation)
