"""Backends `dense`, `dense-tf32`, `dense-channels-last` and `dense-fused` (backends/dense/): every
variant in every dtype it is offered in, against the fp64 reference, with the fused epilogue."""
import pytest
import torch
from helpers.common import sparse_weight
from torch import nn

from sparsecnn import SparseConv2d
from sparsecnn.backends import get_backend
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

DENSE_VARIANTS = ["dense", "dense-tf32", "dense-channels-last", "dense-fused"]
# (C, K, H, kernel, stride, padding): C=3, K=33, H=13, strides 1-3, padding 0-3, 1x1 to 7x7
SHAPES = [(3, 33, 13, 3, 2, 1), (16, 8, 13, 1, 1, 0), (5, 7, 11, 5, 3, 2), (4, 33, 13, 7, 1, 3)]


def _layer(backend, c, k, kernel, stride, padding, activation="relu", sparsity=0.9):
    conv = nn.Conv2d(c, k, kernel, stride, padding)
    with torch.no_grad():
        conv.weight.copy_(sparse_weight(conv.weight.shape, sparsity))
    return conv, SparseConv2d.from_dense(conv, backend, activation=activation)


def _expected(conv, x, residual, relu=True):
    ref = reference_conv(x, conv.weight, conv.bias, stride=conv.stride, padding=conv.padding, fp64=True)
    ref = ref + residual.double() if residual is not None else ref
    return ref.relu() if relu else ref


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_dense_on_cpu_matches_fp64_with_residual_and_relu(shape, batch):
    c, k, h, kernel, stride, padding = shape
    conv, layer = _layer("dense", c, k, kernel, stride, padding)
    x = torch.randn(batch, c, h, h)
    residual = torch.randn(_expected(conv, x, None).shape)
    out = layer(x, residual)
    expected = _expected(conv, x, residual)
    assert out.shape == expected.shape
    if batch:
        assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("name", DENSE_VARIANTS[1:])
def test_cuda_only_variants_say_why_on_cpu(name):
    spec = ConvSpec(N=2, C=3, K=33, H=13, W=13, R=3, S=3, stride=2, padding=1)
    assert get_backend(name).unsupported_reason(spec, torch.float32, "cpu")


def _offered(name):
    return [dtype for dtype in get_backend(name).dtypes.get("cuda", ()) if dtype != torch.float64]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name, dtype", [(name, dtype) for name in DENSE_VARIANTS for dtype in _offered(name)])
def test_every_variant_in_every_offered_dtype_matches_fp64(name, dtype, shape, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    c, k, h, kernel, stride, padding = shape
    conv, layer = _layer(name, c, k, kernel, stride, padding)
    conv, layer = conv.cuda(), layer.cuda().to(dtype)
    x = torch.randn(5, c, h, h, device="cuda")
    expected = _expected(conv, x, None)
    out = layer(x.to(dtype))
    with torch.backends.cudnn.flags(allow_tf32=name == "dense-tf32"):
        own = nn.functional.conv2d(x.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype), stride, padding).relu()
    limit = 1e-5 if (dtype == torch.float32 and name != "dense-tf32") else 2 * relative_error(own, expected) + 1e-6
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert relative_error(out, expected) <= limit
