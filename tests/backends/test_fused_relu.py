"""ReLU compiled into a kernel (`Backend.bind_relu`): chosen by `bind_for` only for layers that ask
for the ReLU and never pass a residual; `SparseConv2d` binds per residual presence, `prepare` per
`takes_residual` (set where `prepare_for_inference` fuses an add); codegen's fused call refuses any
other epilogue."""
import types

import pytest
import torch
import torch.nn.functional as F
from helpers.common import sparse_weight

from sparsecnn.backends import get_backend
from sparsecnn.core import registry
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.core.registry import Backend, KernelCall, apply_epilogue_
from sparsecnn.core.spec import ConvSpec
from sparsecnn.models import build_model
from sparsecnn.nn import SparseConv2d
from sparsecnn.passes.fuse import prepare_for_inference

SPEC = ConvSpec(2, 3, 5, 7, 7, 3, 3, 1, 1)


def _conv(x, weight, bias, residual, relu):
    return apply_epilogue_(F.conv2d(x, weight, bias, padding=1), relu, residual)


def _relu_conv(x, weight, bias, residual, relu):
    if residual is not None or not relu:
        raise ValueError("fused relu only")
    return F.conv2d(x, weight, bias, padding=1).relu_()


@pytest.fixture
def probe(monkeypatch):
    """A registered backend recording which bind ran: 'plain' or 'relu'."""
    binds = []

    def bind(weight, spec, config, dtype, has_bias):
        binds.append("plain")
        return KernelCall(_conv, (weight,))

    def bind_relu(weight, spec, config, dtype, has_bias):
        binds.append("relu")
        return KernelCall(_relu_conv, (weight,))

    backend = Backend("relu-probe", "test", {"cpu": (torch.float32,)}, lambda weight, config: weight, bind,
                      bind_relu=bind_relu)
    monkeypatch.setitem(registry._REGISTRY, backend.name, backend)
    return backend, binds


def test_bind_for_takes_bind_relu_only_when_asked_and_available(probe):
    backend, binds = probe
    weight = sparse_weight(SPEC.weight_shape, 0.5)
    backend.bind_for(weight, SPEC, None, torch.float32, True, relu_only=True)
    backend.bind_for(weight, SPEC, None, torch.float32, True)
    assert binds == ["relu", "plain"]
    dense = get_backend("dense")
    assert dense.bind_relu is None
    assert dense.bind_for(weight, SPEC, None, torch.float32, False, relu_only=True).fn is dense.bind(
        weight, SPEC, None, torch.float32, False).fn
    x = torch.randn(2, 3, 7, 7)
    assert torch.allclose(backend.run(x, weight, None, SPEC, None, relu=True), F.conv2d(x, weight, padding=1).relu())
    assert binds[-1] == "relu"


def test_sparse_conv_binds_per_residual_and_prepares_per_takes_residual(probe):
    backend, binds = probe
    weight, bias = sparse_weight(SPEC.weight_shape, 0.5), torch.randn(5)
    layer = SparseConv2d(weight, bias, padding=1, backend=backend.name, activation="relu")
    x, residual = torch.randn(2, 3, 7, 7), torch.randn(2, 5, 7, 7)
    with torch.no_grad():
        assert torch.allclose(layer(x), F.conv2d(x, weight, bias, padding=1).relu(), atol=1e-6)
        layer(x)
        assert binds == ["relu"]  # bound once
        assert torch.allclose(layer(x, residual), (F.conv2d(x, weight, bias, padding=1) + residual).relu(), atol=1e-6)
        assert binds == ["relu", "plain"]
        layer.activation = "none"  # the plain binding serves every epilogue
        assert torch.allclose(layer(x), F.conv2d(x, weight, bias, padding=1), atol=1e-6)
        assert binds == ["relu", "plain"]
    layer.activation = "relu"
    layer.prepare(x)
    assert layer._binding.key == layer._binding_key(x, False) and binds == ["relu", "plain"]  # both kept
    layer.takes_residual = True
    layer.prepare(x)
    assert layer._binding.key == layer._binding_key(x, True) and "takes_residual=True" in repr(layer)


def test_takes_residual_survives_the_state_dict_and_defaults_to_the_modules_own():
    layer = SparseConv2d(sparse_weight(SPEC.weight_shape, 0.5), padding=1, activation="relu")
    layer.takes_residual = True
    copy = SparseConv2d(sparse_weight(SPEC.weight_shape, 0.5), padding=1)
    copy.load_state_dict(layer.state_dict())
    assert copy.takes_residual and copy.activation == "relu" and not copy.relu_only
    state = layer.get_extra_state()
    del state["takes_residual"]  # e.g. an artefact's manifest entry: the fused model's own value stays
    copy.set_extra_state(state)
    assert copy.takes_residual


def test_prepare_for_inference_marks_the_convs_that_take_the_residual():
    gm = prepare_for_inference(build_model("resnet18-cifar").eval(), example_inputs=torch.randn(1, 3, 32, 32))
    takes = sorted(name for name, m in gm.named_modules() if isinstance(m, SparseConv2d) and m.takes_residual)
    assert takes == sorted(f"layer{i}.{j}.conv2" for i in range(1, 5) for j in range(2))
    assert gm.get_submodule("layer1.0.conv1").relu_only and not gm.get_submodule("layer1.0.conv2").relu_only


def test_codegen_relu_binding_refuses_other_epilogues():
    weight = sparse_weight(SPEC.weight_shape, 0.5)

    class Compiled:  # stands in for compiled kernels (CUDA only) with the ReLU compiled in
        plan = types.SimpleNamespace(spec=SPEC)

        def __call__(self, x, bias):
            return F.conv2d(x, weight, bias, padding=1).relu()

    kernels = Compiled()
    packed = types.SimpleNamespace(compiled=lambda *args, relu=False: kernels if relu else None)
    call = get_backend("codegen").bind_for(packed, SPEC, None, torch.float32, False, relu_only=True)
    x = torch.randn(2, 3, 7, 7)
    assert torch.allclose(call(x, None, None, True), F.conv2d(x, weight, padding=1).relu())
    with pytest.raises(ValueError, match="relu=True and no residual"):
        call(x, None, None, False)
    with pytest.raises(ValueError, match="relu=True and no residual"):
        call(x, None, torch.randn(2, 5, 7, 7), True)


@pytest.mark.gpu
def test_codegen_layer_with_the_relu_compiled_in_matches_the_reference():
    weight = sparse_weight((33, 3, 3, 3), 0.8).cuda()
    bias = torch.randn(33, device="cuda")
    layer = SparseConv2d(weight, bias, padding=1, backend="codegen", activation="relu")
    x, residual = torch.randn(3, 3, 13, 13, device="cuda"), torch.randn(3, 33, 13, 13, device="cuda")
    ref = reference_conv(x, weight, bias, padding=1, fp64=True)
    with torch.no_grad():
        assert relative_error(layer(x), ref.relu()) < 1e-5
        assert layer._binding.call.static[-1] is True  # the ReLU compiled in
        assert relative_error(layer(x, residual), (ref + residual.double()).relu()) < 1e-5
        assert layer._binding.call.static[-1] is False
