import copy

import pytest
import torch
from helpers.common import sparse_weight
from torch import nn

from sparsecnn import SparseConv2d, sparsify_
from sparsecnn.core.reference import reference_conv, relative_error
from sparsecnn.models import MODEL_NAMES, build_model
from sparsecnn.prune import prune_magnitude_

BASELINES = ["dense", "im2col-cublas", "im2col-cusparse"]


def _conv(c=3, k=33, kernel=3, stride=2, padding=1, sparsity=0.9, bias=True):
    conv = nn.Conv2d(c, k, kernel, stride, padding, bias=bias)
    with torch.no_grad():
        conv.weight.copy_(sparse_weight(conv.weight.shape, sparsity))
    return conv


@pytest.mark.parametrize("backend", BASELINES)
@pytest.mark.parametrize("kernel, stride, padding", [(1, 1, 0), (3, 2, 1), (5, 1, 2), (3, 1, 3), (7, 2, 3)])
def test_sparse_conv_matches_fp64_reference(backend, kernel, stride, padding):
    conv = _conv(kernel=kernel, stride=stride, padding=padding)
    x = torch.randn(3, 3, 13, 13)
    layer = SparseConv2d.from_dense(conv, backend)
    ref = reference_conv(x, conv.weight, conv.bias, stride=stride, padding=padding, fp64=True)
    assert relative_error(layer(x), ref) < 1e-6
    assert layer.fallback_reason is None


@pytest.mark.parametrize("backend", BASELINES)
def test_conv1d_is_supported(backend):
    conv = nn.Conv1d(5, 7, 3, stride=2, padding=1)
    with torch.no_grad():
        conv.weight.mul_(torch.rand_like(conv.weight) > 0.6)
    x = torch.randn(2, 5, 19)
    layer = SparseConv2d.from_dense(conv, backend)
    assert relative_error(layer(x), conv(x)) < 1e-6
    assert isinstance(layer.to_dense(), nn.Conv1d)


def test_explicit_mask_is_applied_and_to_dense_round_trips():
    conv = _conv(sparsity=0.0)
    mask = torch.rand(conv.weight.shape) > 0.5
    layer = SparseConv2d.from_dense(conv, "im2col-cusparse", mask=mask)
    dense = layer.to_dense()
    assert torch.equal(dense.weight != 0, mask & (conv.weight != 0))
    x = torch.randn(1, 3, 13, 13)
    assert relative_error(layer(x), dense(x)) < 1e-6


def test_all_zero_weight_yields_the_bias():
    conv = _conv(sparsity=1.0)
    layer = SparseConv2d.from_dense(conv, "im2col-cusparse")
    y = layer(torch.randn(2, 3, 13, 13))
    assert torch.equal(y, conv.bias.view(1, -1, 1, 1).expand_as(y))


@pytest.mark.parametrize("backend", BASELINES)
def test_batch_zero_noncontiguous_and_channels_last(backend):
    layer = SparseConv2d.from_dense(_conv(), backend)
    assert layer(torch.randn(0, 3, 13, 13)).shape == (0, 33, 7, 7)
    x = torch.randn(2, 13, 3, 13).transpose(1, 2)
    assert relative_error(layer(x), layer(x.contiguous())) < 1e-6
    x_cl = torch.randn(2, 3, 13, 13).to(memory_format=torch.channels_last)
    assert relative_error(layer(x_cl), layer(x_cl.contiguous())) < 1e-6


def test_bad_inputs_raise_clear_errors():
    layer = SparseConv2d.from_dense(_conv(), "dense")
    with pytest.raises(ValueError, match="in_channels=3"):
        layer(torch.randn(1, 4, 13, 13))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        layer(torch.randn(3, 13, 13))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(1, 3, 13, 13, dtype=torch.float64))
    with pytest.raises(TypeError, match="Tensor"):
        layer([1.0])
    with pytest.raises(ValueError, match="unknown backend"):
        SparseConv2d.from_dense(_conv(), "nope")
    with pytest.raises(TypeError, match="nn.Conv1d or nn.Conv2d"):
        SparseConv2d.from_dense(nn.Linear(3, 3))


def test_groups_and_dilation_fall_back_to_dense_and_say_so():
    conv = nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2)
    layer = SparseConv2d.from_dense(conv, "im2col-cusparse")
    x = torch.randn(1, 4, 9, 9)
    with pytest.warns(UserWarning, match="falls back to dense"):
        y = layer(x)
    assert relative_error(y, conv(x)) < 1e-6
    assert "fallback=dense" in repr(layer) and "groups=2" in repr(layer)


def test_state_dict_round_trip_keeps_weights_mask_and_backend():
    layer = SparseConv2d.from_dense(_conv(), "im2col-cublas")
    other = SparseConv2d.from_dense(_conv(sparsity=0.5), "dense")
    other.load_state_dict(layer.state_dict())
    assert other.backend == "im2col-cublas"
    assert torch.equal(other.mask, layer.mask) and torch.equal(other.weight, layer.weight)
    assert f"density={layer.density:.3f}" in repr(other) and "backend=im2col-cublas" in repr(other)


def test_a_channels_last_output_holds_the_same_values_and_survives_the_state_dict():
    conv = _conv()
    layer = SparseConv2d.from_dense(conv, "im2col-cublas")
    x = torch.randn(2, 3, 13, 13)
    with torch.no_grad():
        plain = layer(x)
        layer.channels_last_output = True
        handed_on = layer(x)
    assert plain.is_contiguous() and not plain.is_contiguous(memory_format=torch.channels_last)
    assert handed_on.is_contiguous(memory_format=torch.channels_last) and torch.equal(handed_on, plain)
    other = SparseConv2d.from_dense(_conv(), "dense")
    other.load_state_dict(layer.state_dict())
    assert other.channels_last_output and "channels_last_output=True" in repr(other)


def test_weight_update_is_seen_by_the_next_forward():
    layer = SparseConv2d.from_dense(_conv(), "im2col-cusparse")
    x = torch.randn(1, 3, 13, 13)
    layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    assert relative_error(layer(x), layer.to_dense()(x)) < 1e-6


@pytest.mark.quick_sample(6)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sparsify_matches_the_dense_masked_model(name):
    from sparsecnn.models import default_input_shape

    model = build_model(name).eval()
    prune_magnitude_(model, 0.9)
    shape = default_input_shape(name)
    size = 64 if shape[1] == 224 else shape[1]
    x = torch.randn(1, shape[0], size, size)
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
        sparse = sparsify_(copy.deepcopy(model), backend="im2col-cusparse")
        out = sparse(x)
    assert relative_error(out, ref) < 1e-5
    assert not any(isinstance(m, nn.Conv2d) for m in sparse.modules())


def test_sparsify_auto_times_candidates_and_respects_filter():
    model = nn.Sequential(_conv(), nn.ReLU(), _conv(c=33, k=8, stride=1))
    x = torch.randn(2, 3, 13, 13)
    ref = model(x)
    sparsify_(model, x, filter_fn=lambda name, module: name == "2")
    assert isinstance(model[0], nn.Conv2d) and isinstance(model[2], SparseConv2d)
    assert set(model[2].timings) == set(BASELINES)
    assert relative_error(model(x), ref) < 1e-6


def test_sparsify_auto_needs_example_inputs():
    with pytest.raises(ValueError, match="example_inputs"):
        sparsify_(nn.Sequential(_conv()))


def test_import_does_not_initialise_cuda():
    import subprocess
    import sys

    code = "import sparsecnn, sparsecnn.bench, sparsecnn.cli, torch; assert not torch.cuda.is_initialized()"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparsify_accepts_a_model_pruned_with_torch_prune():
    from torch.nn.utils import prune

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    for conv in (model[0], model[2]):
        prune.l1_unstructured(conv, "weight", amount=0.8)
    x = torch.randn(2, 3, 13, 13)
    ref = model(x)
    masks = [model[0].weight_mask.bool(), model[2].weight_mask.bool()]
    sparsify_(model, backend="im2col-cusparse")
    assert torch.equal(model[0].mask, masks[0]) and torch.equal(model[2].mask, masks[1])
    assert relative_error(model(x), ref) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BASELINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_baselines_on_cuda_match_reference(backend, dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    conv = _conv(kernel=3, stride=2, padding=1).cuda()
    x = torch.randn(3, 3, 13, 13, device="cuda")
    ref = reference_conv(x, conv.weight, conv.bias, stride=2, padding=1, fp64=True)
    layer = SparseConv2d.from_dense(conv, backend).to(dtype)
    out = layer(x.to(dtype))
    cudnn_err = relative_error(nn.functional.conv2d(x.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype), 2, 1), ref)
    limit = 1e-5 if dtype == torch.float32 else 2 * cudnn_err + 1e-4
    assert out.dtype == dtype and relative_error(out, ref) < limit


@pytest.mark.gpu
@pytest.mark.timing
def test_sparsify_auto_on_cuda_matches_dense(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 exact: cuDNN defaults to TF32
    model = build_model("resnet18-cifar").eval().cuda()
    prune_magnitude_(model, 0.9)
    x = torch.randn(4, 3, 32, 32, device="cuda")
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        sparse = sparsify_(model, x)
        assert relative_error(sparse(x), ref) < 1e-5
    assert all(m.timings for m in sparse.modules() if isinstance(m, SparseConv2d))


def test_bound_weights_are_marked_static_as_dynamo_marks_them():
    # SparseConv2d marks CUDA weights itself until torch._dynamo is imported (1-5 s to import)
    import torch._dynamo

    from sparsecnn.nn.static import STATIC_INPUT_TYPE

    marked = torch.zeros(2)
    torch._dynamo.mark_static_address(marked)
    assert marked._dynamo_static_input_type == STATIC_INPUT_TYPE


def test_each_input_shape_keeps_its_binding_up_to_max_bindings():
    from sparsecnn.nn.sparse_conv import MAX_BINDINGS

    layer = SparseConv2d.from_dense(_conv(), "im2col-cusparse")
    first = layer.prepare(torch.randn(1, 3, 13, 13))._binding
    second = layer.prepare(torch.randn(2, 3, 13, 13))._binding
    assert first is not second and layer.prepare(torch.randn(1, 3, 13, 13))._binding is first  # kept, not rebound
    for batch in range(3, MAX_BINDINGS + 2):  # MAX_BINDINGS - 1 more shapes drop the least recently used, batch 2
        layer.prepare(torch.randn(batch, 3, 13, 13))
    assert len(layer._bindings) == MAX_BINDINGS
    assert [key[1][0] for key in layer._bindings] == [1, *range(3, MAX_BINDINGS + 2)]
    assert layer._current_binding(torch.randn(1, 3, 13, 13), False) is first
    state = layer.backend_state()
    layer.set_backend("dense", None)
    assert layer._binding is None
    layer.restore_backend(state)
    assert layer._binding is state[-1][next(reversed(state[-1]))]


def test_a_weight_edit_rebinds_the_shape_called_and_keeps_the_others():
    layer = SparseConv2d.from_dense(_conv(), "im2col-cublas")
    x1, x2 = torch.randn(1, 3, 13, 13), torch.randn(2, 3, 13, 13)
    layer(x1)
    old = layer._bindings.copy()
    layer(x2)
    with torch.no_grad():
        layer.weight.mul_(2)
    assert relative_error(layer(x1), layer.to_dense()(x1)) < 1e-6
    key1 = next(iter(old))
    assert layer._bindings[key1] is not old[key1] and layer._binding is layer._bindings[key1]
