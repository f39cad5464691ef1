import pytest
import torch
from torch import nn

from sparsecnn.core.spec import ConvSpec
from sparsecnn.layers import get_suite, suite_names
from sparsecnn.layers.suites import DLMC_STUDY_LAYERS, specs_from_model


def test_output_size_and_flops_match_conv2d():
    spec = ConvSpec(2, 3, 5, 13, 11, 3, 5, stride=2, padding=(1, 2))
    y = nn.functional.conv2d(torch.randn(spec.input_shape), torch.randn(spec.weight_shape), stride=2, padding=(1, 2))
    assert tuple(y.shape) == spec.output_shape
    assert spec.dense_flops == 2 * y.numel() * 3 * 3 * 5


def test_min_bytes_counts_sparse_weights_with_indices():
    spec = ConvSpec(1, 4, 8, 10, 10, 3, 3, padding=1)
    activations = 4 * (4 * 100 + 8 * 100)
    assert spec.min_bytes(4, 1.0) == activations + 4 * 8 * 4 * 9
    assert spec.min_bytes(4, 0.25) == activations + round(0.25 * 288) * 8


@pytest.mark.parametrize("field, value", [("C", 0), ("stride", (1, 2, 3)), ("groups", 2)])
def test_bad_spec_raises(field, value):
    kwargs = dict(N=1, C=3, K=4, H=8, W=8, R=3, S=3)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field if field != "groups" else "groups"):
        ConvSpec(**kwargs)


def test_empty_output_raises():
    with pytest.raises(ValueError, match="empty output"):
        ConvSpec(1, 3, 4, 2, 2, 5, 5)


def test_dong_suite_uses_output_sizes_from_the_paper():
    specs = {s.name: s for s in get_suite("dong")}
    assert len(specs) == 10 and all(s.N == 64 for s in specs.values())
    assert (specs["lenet-conv1"].P, specs["alexnet-conv3"].P, specs["vgg-conv3"].P) == (24, 8, 112)
    # Table 2 counts FLOPs at batch 64: lenet-conv1 is 2 * 64 * 20 * 24 * 24 * 25 = 36.9 MFLOP
    assert specs["lenet-conv1"].dense_flops == 36_864_000


@pytest.mark.slow
def test_every_suite_builds_with_its_paper_batch():
    batches = {"pietron-vgg16": 128, "pietron-r50-1x1": 128, "optprune-resnet18-cifar": 32, "resnet50": 32,
               "pietron-cnn1d": 128}
    for name in suite_names():
        specs = get_suite(name)
        assert specs and all(s.name for s in specs)
        if name in batches:
            assert specs[0].N == batches[name]


def test_cnn1d_suite_is_conv1d_as_one_row():
    specs = {s.name: s for s in get_suite("pietron-cnn1d")}
    k3 = specs["cnn1d-64x300-k3"]
    assert (k3.H, k3.R, k3.W, k3.S, k3.P, k3.Q) == (1, 1, 300, 3, 1, 298)
    assert k3.dense_flops == 2 * 128 * 64 * 64 * 3 * 298


def test_resnet50_suite_is_every_conv_by_module_name():
    specs = get_suite("resnet50", batch=1)
    assert len(specs) == 53
    assert specs[0].name == "conv1" and (specs[0].R, specs[0].stride) == (7, (2, 2))
    assert {"layer1.0.downsample.0", "layer4.2.conv3"} <= {s.name for s in specs}


def test_unknown_suite_names_the_choices():
    with pytest.raises(ValueError, match="dong"):
        get_suite("nope")


def test_conv1d_spec_from_model():
    model = nn.Sequential(nn.Conv1d(4, 6, 3, stride=2, padding=1))
    (spec,) = specs_from_model(model, (2, 4, 17))
    assert (spec.H, spec.R, spec.W, spec.S, spec.Q) == (1, 1, 17, 3, 9)


def test_launch_spec_is_the_layers_spec_built_once_per_shape():
    from sparsecnn.core.checks import launch_spec

    spec = launch_spec((3, 5, 13, 11), (33, 5, 3, 3), (2, 2), (1, 1))
    assert spec == ConvSpec(3, 5, 33, 13, 11, 3, 3, 2, 1)
    assert spec.output_shape == (3, 33, 7, 6)
    assert launch_spec((3, 5, 13, 11), (33, 5, 3, 3), (2, 2), (1, 1)) is spec
    with pytest.raises(ValueError):
        launch_spec((3, 5, 2, 2), (33, 5, 3, 3), (1, 1), (0, 0))  # no output pixel: refused as ConvSpec refuses it


def test_the_dlmc_study_layers_are_sixteen_distinct_resnet50_layers():
    names = [spec.name for spec in get_suite("resnet50", 1)]
    assert len(set(DLMC_STUDY_LAYERS)) == len(DLMC_STUDY_LAYERS) == 16
    assert set(DLMC_STUDY_LAYERS) <= set(names)
