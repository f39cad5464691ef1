"""Batch sizes 1 and 0 through every registered backend, as models call them (SparseConv2d), in
every dtype the backend is offered in on its device.

N=1: the values, with each epilogue (none, ReLU alone, which binds `bind_relu` where a backend has
one, and residual + ReLU), against the fp64 reference: 1e-5 in fp32, 1e-10 in fp64, and within 2x
the error of PyTorch's own conv in that precision for fp16/bf16/TF32. N=0: an empty (0, K, P, Q)
output of the input's dtype and device, with nothing packed, bound, launched or run densely.

CPU: the backends that run there (`direct` and `blocks` in Triton's interpreter, TRITON_INTERPRET=1
as `make test` sets it). GPU (`gpu` marker): every backend in every CUDA dtype, the generated ones
(codegen, staged, unrolled) and the CUDA-only dense variants included. `staged` needs a batch that
is a multiple of 32: at N=1 it must fall back to dense, say why, and still be right.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers.common import needs_interpreter, sparse_weight

from sparsecnn.backends import get_backend
from sparsecnn.core import registry
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec
from sparsecnn.nn import SparseConv2d

# Odd sizes, a rectangular stride; K = 64 so that blocks' row groups (K / 8 rows) can hold a block.
SPEC = ConvSpec(1, 5, 64, 9, 7, 3, 3, (2, 1), 1)
TRITON_BACKENDS = ("direct", "blocks", "tensorcore")  # run on the CPU in Triton's interpreter only
FALLS_BACK_AT_N1 = {"staged": "multiple of 32"}  # backend -> what its reason for refusing N=1 says
EPILOGUES = {"none": (False, False), "relu": (True, False), "residual-relu": (True, True)}  # (relu, residual)

# Triton's interpreter converts a tensor loop bound with int() on a 1-element array (numpy warns).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _cpu_cases():
    cases = []
    for name in registry.backend_names():
        if name in TRITON_BACKENDS:
            cases.append(pytest.param(name, torch.float32, marks=needs_interpreter, id=f"{name}-float32"))
        else:
            cases += [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")
                      for dtype in get_backend(name).dtypes.get("cpu", ())]
    return cases


def _gpu_cases():
    return [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")
            for name in registry.backend_names() for dtype in get_backend(name).dtypes.get("cuda", ())]


CPU_CASES, GPU_CASES = _cpu_cases(), _gpu_cases()


def test_every_backend_and_dtype_is_covered():
    """Each registered backend has CPU or GPU cases, each in every dtype it is offered in."""
    names = registry.backend_names()
    assert set(TRITON_BACKENDS) | set(FALLS_BACK_AT_N1) <= set(names)
    assert {case.values[0] for case in GPU_CASES} == set(names)
    assert {"dense", "im2col-cublas", "im2col-cusparse", *TRITON_BACKENDS} <= {case.values[0] for case in CPU_CASES}
    assert len(GPU_CASES) == sum(len(get_backend(name).dtypes.get("cuda", ())) for name in names)


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 convs and matmuls exact (PyTorch lets cuDNN round fp32 products to TF32 by default)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _layer(backend, dtype, device, relu):
    gen = torch.Generator().manual_seed(0)
    weight = sparse_weight(SPEC.weight_shape, 0.7, gen)
    weight[5] = 0  # a fully pruned output channel: its output is the bias alone
    layer = SparseConv2d(weight, torch.randn(SPEC.K, generator=gen), stride=SPEC.stride, padding=SPEC.padding,
                         backend=backend, activation="relu" if relu else "none")
    return layer.to(device, dtype)


def _inputs(shape, seed, device, dtype):
    """Random, shifted so that ReLU keeps some outputs and zeroes others."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) + 0.1).to(device=device, dtype=dtype)


def _limit(backend, layer, x, residual, relu, ref):
    """1e-10 in fp64, 1e-5 in exact fp32; else 2x the error of PyTorch's conv at the same precision
    (TF32 products for dense-tf32), plus 1e-4 for the noise of so few outputs."""
    dtype = x.dtype
    if dtype == torch.float64:
        return 1e-10
    if dtype == torch.float32 and backend != "dense-tf32":
        return 1e-5
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=backend == "dense-tf32"):
        own = F.conv2d(x, layer.weight, layer.bias, SPEC.stride, SPEC.padding)
        own = own if residual is None else own + residual
        own = own.relu() if relu else own
    return 2 * relative_error(own, ref) + 1e-4


def _check_batch_of_one(backend, dtype, device, epilogue):
    relu, with_residual = EPILOGUES[epilogue]
    layer = _layer(backend, dtype, device, relu)
    x = _inputs(SPEC.input_shape, 1, device, dtype)
    assert x.shape[0] == 1
    residual = _inputs(SPEC.output_shape, 2, device, dtype) if with_residual else None
    with torch.no_grad():
        if backend in FALLS_BACK_AT_N1:
            with pytest.warns(UserWarning, match="falls back to dense"):
                y = layer(x, residual)
            assert FALLS_BACK_AT_N1[backend] in layer.fallback_reason
        else:
            y = layer(x, residual)
            assert layer.fallback_reason is None
    ref = reference_conv(x, layer.weight, layer.bias, stride=SPEC.stride, padding=SPEC.padding, fp64=True)
    ref = ref if residual is None else ref + residual.double()
    ref = ref.relu() if relu else ref
    assert y.shape == SPEC.output_shape and y.dtype == dtype and y.device == x.device
    if relu:
        assert (ref == 0).any() and (ref > 0).any()
    assert relative_error(y, ref) < _limit(backend, layer, x, residual, relu, ref)


def _refuse(*args, **kwargs):
    raise AssertionError("an empty batch packed, bound or ran something")


def _check_empty_batch(backend, dtype, device, monkeypatch):
    layer = _layer(backend, dtype, device, relu=True)
    registered = get_backend(backend)
    # From here on any packing, binding or launch through the registry fails, and so does the dense path.
    monkeypatch.setitem(registry._REGISTRY, backend, dataclasses.replace(
        registered, prepare=_refuse, bind=_refuse, bind_relu=registered.bind_relu and _refuse,
        bind_pooled=registered.bind_pooled and _refuse))
    monkeypatch.setattr(layer, "_dense", _refuse)
    x = _inputs(SPEC.input_shape, 1, device, dtype)[:0]
    residual = _inputs(SPEC.output_shape, 2, device, dtype)[:0]
    with torch.no_grad():
        for y in (layer(x), layer(x, residual)):
            assert y.shape == (0, SPEC.K, SPEC.P, SPEC.Q) and y.dtype == dtype and y.device == x.device
    assert layer._binding.call is None and layer._binding.packed is None


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("backend, dtype", CPU_CASES)
def test_batch_of_one_matches_fp64(backend, dtype, epilogue):
    _check_batch_of_one(backend, dtype, "cpu", epilogue)


@pytest.mark.parametrize("backend, dtype", CPU_CASES)
def test_empty_batch_is_empty_without_launching(backend, dtype, monkeypatch):
    _check_empty_batch(backend, dtype, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("backend, dtype", GPU_CASES)
def test_gpu_batch_of_one_matches_fp64(backend, dtype, epilogue, exact_fp32):
    _check_batch_of_one(backend, dtype, "cuda", epilogue)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype", GPU_CASES)
def test_gpu_empty_batch_is_empty_without_launching(backend, dtype, monkeypatch):
    _check_empty_batch(backend, dtype, "cuda", monkeypatch)
