"""Backends `im2col-cublas` and `im2col-cusparse` (backends/im2col/): odd shapes against the fp64
reference, the fused epilogue, and the op's fake implementation."""
import pytest
import torch
from helpers.common import sparse_weight
from torch import nn

from sparsecnn import SparseConv2d
from sparsecnn.core.reference import reference_conv, relative_error

BACKENDS = ["im2col-cublas", "im2col-cusparse"]
# (C, K, H, kernel, stride, padding): C=3, K=33, H=13, strides 1-3, padding 0-3, 1x1 to 7x7
SHAPES = [(3, 33, 13, 3, 2, 1), (16, 8, 13, 1, 1, 0), (5, 7, 11, 5, 3, 2), (4, 33, 13, 7, 1, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("sparsity", [0.0, 0.9, 1.0])
def test_matches_fp64_with_residual_and_relu(backend, shape, batch, sparsity):
    c, k, h, kernel, stride, padding = shape
    conv = nn.Conv2d(c, k, kernel, stride, padding)
    with torch.no_grad():
        conv.weight.copy_(sparse_weight(conv.weight.shape, sparsity))
    layer = SparseConv2d.from_dense(conv, backend, activation="relu")
    x = torch.randn(batch, c, h, h)
    expected = reference_conv(x, conv.weight, conv.bias, stride=stride, padding=padding, fp64=True)
    residual = torch.randn(expected.shape)
    expected = (expected + residual.double()).relu()
    out = layer(x, residual)
    assert out.shape == expected.shape and torch.isfinite(out).all()
    if batch:
        assert relative_error(out, expected) < 1e-5


def test_the_spmm_op_has_a_fake_implementation_that_passes_opcheck():
    from sparsecnn.backends.im2col.backend import _csr_arrays

    weight = sparse_weight((33, 3, 3, 3), 0.9)
    crow, col, values = _csr_arrays(weight, None)
    x = torch.randn(2, 3, 13, 13)
    torch.library.opcheck(torch.ops.sparsecnn.im2col_csr_conv2d.default,
                          (x, crow, col, values, torch.randn(33), [33, 3, 3, 3], [2, 2], [1, 1], [1, 1]))
