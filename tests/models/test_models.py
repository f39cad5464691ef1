import functools

import pytest
import torch
from helpers.common import run_python

from sparsecnn.models import (
    MODEL_NAMES,
    build_model,
    build_skeleton,
    default_input_shape,
)

_build = functools.lru_cache(maxsize=None)(build_model)  # each model is built once per session

_CLASSES = {"resnet18-cifar": 10, "vgg16-cifar": 10, "lenet5": 10, "alexnet-cifar": 10}


def _count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_shape(name):
    model = _build(name).eval()
    shape = default_input_shape(name)
    batch = 1 if shape[1] == 224 else 2
    with torch.no_grad():
        out = model(torch.randn(batch, *shape))
    assert out.shape == (batch, _CLASSES.get(name, 1000))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_runs_on_meta_device(name):
    model = build_model(name).to("meta")
    out = model(torch.empty(2, *default_input_shape(name), device="meta"))
    assert out.shape == (2, _CLASSES.get(name, 1000))


# torchvision's numbers (googlenet with aux_logits=False)
@pytest.mark.parametrize("name, params, keys", [
    ("resnet18", 11_689_512, 122),
    ("resnet34", 21_797_672, 218),
    ("resnet50", 25_557_032, 320),
    ("vgg16", 138_357_544, 32),
    ("googlenet", 6_624_904, 344),
])
def test_torchvision_counts(name, params, keys):
    model = _build(name)
    assert _count(model) == params
    assert len(model.state_dict()) == keys


@pytest.mark.parametrize("name, key, shape", [
    ("resnet18", "conv1.weight", (64, 3, 7, 7)),
    ("resnet18", "layer2.0.downsample.0.weight", (128, 64, 1, 1)),
    ("resnet18", "layer4.1.bn2.num_batches_tracked", ()),
    ("resnet18", "fc.weight", (1000, 512)),
    ("resnet50", "layer1.0.downsample.0.weight", (256, 64, 1, 1)),
    ("resnet50", "layer1.0.downsample.1.running_var", (256,)),
    ("resnet50", "layer2.0.conv2.weight", (128, 128, 3, 3)),
    ("resnet50", "layer4.2.conv3.weight", (2048, 512, 1, 1)),
    ("resnet50", "fc.weight", (1000, 2048)),
    ("vgg16", "features.0.weight", (64, 3, 3, 3)),
    ("vgg16", "features.28.weight", (512, 512, 3, 3)),
    ("vgg16", "classifier.0.weight", (4096, 25088)),
    ("vgg16", "classifier.3.bias", (4096,)),
    ("vgg16", "classifier.6.weight", (1000, 4096)),
    ("vgg16-cifar", "classifier.0.weight", (10, 512)),
    ("googlenet", "conv1.conv.weight", (64, 3, 7, 7)),
    ("googlenet", "conv1.bn.running_mean", (64,)),
    ("googlenet", "conv3.conv.weight", (192, 64, 3, 3)),
    ("googlenet", "inception3a.branch3.1.conv.weight", (32, 16, 3, 3)),
    ("googlenet", "inception4a.branch2.1.conv.weight", (208, 96, 3, 3)),
    ("googlenet", "inception5b.branch4.1.conv.weight", (128, 832, 1, 1)),
    ("googlenet", "fc.weight", (1000, 1024)),
    ("resnet18-cifar", "conv1.weight", (64, 3, 3, 3)),
    ("resnet18-cifar", "fc.weight", (10, 512)),
    ("lenet5", "fc1.weight", (500, 800)),
    ("alexnet-cifar", "fc.weight", (10, 1024)),
])
def test_state_dict_key(name, key, shape):
    sd = _build(name).state_dict()
    assert key in sd
    assert tuple(sd[key].shape) == shape


def test_googlenet_has_no_aux_or_biased_convs():
    sd = _build("googlenet").state_dict()
    assert not any(k.startswith("aux") for k in sd)
    assert not any(k.endswith("conv.bias") for k in sd)
    assert _build("googlenet").conv1.bn.eps == 1e-3


def test_resnet18_cifar_shares_names_with_resnet18():
    assert _build("resnet18-cifar").state_dict().keys() == _build("resnet18").state_dict().keys()


def _conv_inputs(name):
    model = build_model(name).to("meta")
    sizes = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: sizes.__setitem__(n, tuple(args[0].shape[2:])))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    model(torch.empty(1, *default_input_shape(name), device="meta"))
    for h in hooks:
        h.remove()
    return sizes


def test_small_net_spatial_sizes():
    assert _conv_inputs("alexnet-cifar") == {"conv1": (32, 32), "conv2": (16, 16), "conv3": (8, 8)}
    assert _conv_inputs("lenet5") == {"conv1": (28, 28), "conv2": (12, 12)}
    r18c = _conv_inputs("resnet18-cifar")
    assert r18c["layer1.0.conv1"] == (32, 32) and r18c["layer4.1.conv2"] == (4, 4)


@pytest.mark.parametrize("name", ["resnet18", "vgg16-cifar", "lenet5", "alexnet-cifar"])
def test_num_classes_override(name):
    model = build_model(name, num_classes=7).eval()
    with torch.no_grad():
        out = model(torch.randn(1, *default_input_shape(name)))
    assert out.shape == (1, 7)


def test_unknown_name():
    with pytest.raises(ValueError, match="resnet50"):
        build_model("resnet51")
    with pytest.raises(ValueError, match="googlenet"):
        default_input_shape("inception")


@pytest.mark.parametrize("name", ["resnet50", "googlenet", "alexnet-cifar"])
def test_skeleton_has_the_models_structure(name):
    built, skeleton = build_model(name, 7).state_dict(), build_skeleton(name, 7).state_dict()
    assert {key: (value.shape, value.dtype) for key, value in skeleton.items()} == \
           {key: (value.shape, value.dtype) for key, value in built.items()}
    assert all(value.device.type == "cpu" for value in skeleton.values())


def test_skeleton_builds_and_simplifies_without_importing_dynamo_or_sympy():
    # Meta-device ops import torch._dynamo, torch's ShapeProp imports sympy: seconds of every artefact load.
    code = ("import sys, torch\nfrom sparsecnn.models import build_skeleton\nfrom sparsecnn.passes import "
            "prepare_for_inference\nprepare_for_inference(build_skeleton('resnet18'), example_inputs=torch.zeros(1, 3, "
            "32, 32))\nassert not {'torch._dynamo', 'sympy'} & set(sys.modules), 'imported torch._dynamo or sympy'")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
