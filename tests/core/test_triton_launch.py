"""The eager fast paths: Triton launches by specialisation key (`kernels/triton/launch.py`) and the
direct backend's per-layer plan (`BoundDirectCall`). CPU tests run the plan in Triton's interpreter;
the compiled-kernel launches need the GPU."""
import types

import pytest
import torch
from helpers.common import needs_cuda, needs_interpreter, sparse_weight

from sparsecnn.backends import get_backend
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.spec import ConvSpec

gpu = pytest.mark.gpu
VARIANTS = ["chunk", "batch"]


def _fake_kernel(*specialised: bool):
    params = [types.SimpleNamespace(do_not_specialize=not flag, do_not_specialize_on_alignment=False)
              for flag in specialised]
    return types.SimpleNamespace(params=params)


def test_specialisation_key_separates_what_triton_compiles_apart():
    from sparsecnn.core.triton_launch import _specialisation

    kernel = _fake_kernel(True, True, False)
    base = torch.zeros(64)
    aligned, misaligned = base[:8], base[1:9]
    key = _specialisation(kernel, (aligned, 32, 7))
    assert key != _specialisation(kernel, (misaligned, 32, 7))        # pointer alignment
    assert key != _specialisation(kernel, (aligned.double(), 32, 7))  # pointer dtype
    assert key != _specialisation(kernel, (aligned, 33, 7))           # divisibility by 16
    assert key != _specialisation(kernel, (aligned, 1, 7))            # the value 1
    assert key != _specialisation(kernel, (aligned, 32, 2 ** 40))     # i64, even when not specialised
    assert key == _specialisation(kernel, (base[16:24], 48, 9))      # what compiles to the same kernel


def _layer(variant: str, device: str = "cpu", spec: ConvSpec = ConvSpec(4, 3, 5, 9, 7, 3, 3, 2, 1)):
    """(spec, weight, bias, KernelCall) of a bound `direct` layer of the given variant."""
    from sparsecnn.backends.direct.kernel import auto_configs

    config = next(c for c in auto_configs(spec) if c.variant == variant)
    weight = sparse_weight(spec.weight_shape, 0.7).to(device)
    backend = get_backend("direct")
    call = backend.bind(backend.prepare(weight, config), spec, config, torch.float32, True)
    return spec, weight, torch.randn(spec.K, device=device), call


def _expected(x, weight, bias, residual, spec):
    conv = reference_conv(x, weight, bias, stride=spec.stride, padding=spec.padding, fp64=True)
    return torch.relu(conv + residual.double())


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_bound_direct_call_plans_once_and_matches_the_reference(variant):
    spec, weight, bias, call = _layer(variant)
    residual = torch.randn(spec.output_shape)
    for attempt in range(3):
        x = torch.randn(spec.input_shape)
        y = call(x, bias, residual, relu=True)
        assert relative_error(y, _expected(x, weight, bias, residual, spec)) < 1e-6, attempt
        assert call.eager._plan is not None


@needs_interpreter
def test_bound_direct_call_checks_what_changes_between_calls():
    spec, weight, bias, call = _layer("batch")
    x = torch.randn(spec.input_shape)
    call(x, bias, None)
    with pytest.raises(ValueError, match="bind the weight for this input size"):
        call(torch.randn(4, 3, 11, 7), bias, None)
    with pytest.raises(ValueError, match="bias must be"):
        call(x, torch.randn(spec.K + 1), None)
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        call(x, bias, torch.randn(4, spec.K, 1, 1))
    with pytest.raises(TypeError, match="dtype"):
        call(x.double(), bias, None)


def _poisoned_cache(nbytes: int) -> None:
    """Fill freed allocator blocks with NaN, so an output the kernel leaves unwritten shows."""
    torch.empty(nbytes // 4, device="cuda").fill_(float("nan"))


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_launches_match_the_reference_for_aligned_and_misaligned_inputs(variant, monkeypatch):
    from triton.runtime.jit import JITFunction

    spec, weight, bias, call = _layer(variant, "cuda", ConvSpec(32, 3, 33, 13, 13, 3, 3, 1, 1))

    def views(shape, offset):  # offset 1: a tensor at 4 bytes past a 16-byte boundary
        numel = torch.Size(shape).numel()
        return torch.randn(numel + 1, device="cuda")[offset:offset + numel].view(shape)

    def run_and_check(offset):
        x, residual = views(spec.input_shape, offset), views(spec.output_shape, offset)
        _poisoned_cache(4 * 8 * torch.Size(spec.output_shape).numel())
        y = call(x, bias, residual, relu=True)
        assert relative_error(y, _expected(x, weight, bias, residual, spec)) < 1e-6, offset

    for offset in [0, 1]:  # Triton's own launches compile and fill the cache
        run_and_check(offset)

    def no_jit_launch(*args, **kwargs):
        raise AssertionError("launched through JITFunction.run: the compiled-kernel cache missed")

    monkeypatch.setattr(JITFunction, "run", no_jit_launch)
    for offset in [0, 1]:
        run_and_check(offset)


def test_no_launch_hook_by_default():
    from sparsecnn.core.triton_launch import _hooked

    assert not _hooked()
