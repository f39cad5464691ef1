"""Named layer suites from the papers in shared/papers, and suites read off our models.

Static suites list (name, C, K, H_in, R, stride, padding); paper 002 Table 2 gives the *output*
size, converted here to the input size. The 1-D suite lists (name, C, K, length, kernel size) of
Conv1d layers (stride 1, no padding), described as H = R = 1.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from sparsecnn.core.spec import ConvSpec

# The 16 ResNet-50 layers the DLMC tile and unit studies time (issues 32 and 45; suite "resnet50").
DLMC_STUDY_LAYERS: Tuple[str, ...] = (
    "layer1.0.conv1", "layer1.0.conv2", "layer1.0.conv3", "layer2.0.conv2", "layer2.1.conv1", "layer2.1.conv2",
    "layer2.1.conv3", "layer3.0.conv2", "layer3.1.conv1", "layer3.1.conv2", "layer3.1.conv3", "layer4.0.conv2",
    "layer4.1.conv1", "layer4.1.conv2", "layer4.1.conv3", "layer2.0.downsample.0")

_Row = Tuple[str, int, int, int, int, int, int]
_Row1d = Tuple[str, int, int, int, int]

DONG: List[_Row] = [
    ("lenet-conv1", 1, 20, 28, 5, 1, 0), ("lenet-conv2", 20, 50, 12, 5, 1, 0),
    ("alexnet-conv1", 3, 32, 32, 5, 1, 2), ("alexnet-conv2", 32, 32, 16, 5, 1, 2),
    ("alexnet-conv3", 32, 64, 8, 5, 1, 2), ("resnet-conv1", 64, 64, 56, 3, 1, 1),
    ("resnet-conv2", 128, 128, 28, 3, 1, 1), ("vgg-conv1", 3, 64, 224, 3, 1, 1),
    ("vgg-conv2", 64, 64, 224, 3, 1, 1), ("vgg-conv3", 64, 128, 112, 3, 1, 1),
]
PIETRON_VGG16: List[_Row] = [
    ("vgg-64x224-64", 64, 64, 224, 3, 1, 1), ("vgg-64x112-128", 64, 128, 112, 3, 1, 1),
    ("vgg-128x112-128", 128, 128, 112, 3, 1, 1), ("vgg-128x56-256", 128, 256, 56, 3, 1, 1),
    ("vgg-256x56-256", 256, 256, 56, 3, 1, 1), ("vgg-256x28-512", 256, 512, 28, 3, 1, 1),
    ("vgg-512x28-512", 512, 512, 28, 3, 1, 1), ("vgg-512x14-512", 512, 512, 14, 3, 1, 1),
]
PIETRON_R50_1X1: List[_Row] = [
    ("r50-1x1-64-256", 64, 256, 56, 1, 1, 0), ("r50-1x1-256-64", 256, 64, 56, 1, 1, 0),
]
OPTPRUNE_R18_CIFAR: List[_Row] = [
    ("r18c-conv1", 3, 64, 32, 3, 1, 1), ("r18c-layer1", 64, 64, 32, 3, 1, 1),
    ("r18c-layer2.0", 64, 128, 32, 3, 2, 1), ("r18c-layer2", 128, 128, 16, 3, 1, 1),
    ("r18c-layer3.0", 128, 256, 16, 3, 2, 1), ("r18c-layer3", 256, 256, 8, 3, 1, 1),
    ("r18c-layer4.0", 256, 512, 8, 3, 2, 1), ("r18c-layer4", 512, 512, 4, 3, 1, 1),
]

# Paper 003 Table 8: the 1-D CNN autoencoder's layer "input 300x64" with kernels 2 and 3 (batch 128).
# The paper gives no output channel count; 64 (as many as the input's) is our reading.
PIETRON_CNN1D: List[_Row1d] = [
    ("cnn1d-64x300-k2", 64, 64, 300, 2), ("cnn1d-64x300-k3", 64, 64, 300, 3),
]


def _static(rows: List[_Row], batch: int) -> List[ConvSpec]:
    return [ConvSpec(batch, c, k, h, h, r, r, s, p, name=name) for name, c, k, h, r, s, p in rows]


def _static_1d(rows: List[_Row1d], batch: int) -> List[ConvSpec]:
    return [ConvSpec(batch, c, k, 1, length, 1, size, name=name) for name, c, k, length, size in rows]


def specs_from_model(model: torch.nn.Module, input_shape: Tuple[int, ...]) -> List[ConvSpec]:
    """Every Conv1d/Conv2d of `model` at `input_shape` (with batch), in call order, named by module path.

    Runs the model on the meta device, so nothing is computed or allocated.
    """
    model = model.to("meta")
    names = {module: name for name, module in model.named_modules()}
    specs: List[ConvSpec] = []

    def record(module, args, _output):
        specs.append(ConvSpec.from_conv(module, tuple(args[0].shape), names[module]))

    hooks = [m.register_forward_hook(record) for m in model.modules()
             if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d))]
    try:
        with torch.no_grad():
            model(torch.empty(input_shape, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    return specs


def _from_model(model_name: str, hw: int) -> Callable[[int], List[ConvSpec]]:
    def build(batch: int) -> List[ConvSpec]:
        from sparsecnn.models import build_model

        return specs_from_model(build_model(model_name), (batch, 3, hw, hw))

    return build


# name -> (specs for a batch size, default batch size)
SUITES: Dict[str, Tuple[Callable[[int], List[ConvSpec]], int]] = {
    "dong": (lambda n: _static(DONG, n), 64),
    "pietron-vgg16": (lambda n: _static(PIETRON_VGG16, n), 128),
    "pietron-r50-1x1": (lambda n: _static(PIETRON_R50_1X1, n), 128),
    "optprune-resnet18-cifar": (lambda n: _static(OPTPRUNE_R18_CIFAR, n), 32),
    "pietron-cnn1d": (lambda n: _static_1d(PIETRON_CNN1D, n), 128),
    "resnet50": (_from_model("resnet50", 224), 32),
    "vgg16": (_from_model("vgg16", 224), 32),
    "googlenet": (_from_model("googlenet", 224), 32),
}


def suite_names() -> List[str]:
    return list(SUITES)


def get_suite(name: str, batch: int | None = None) -> List[ConvSpec]:
    """The layers of suite `name` at batch `batch` (the paper's batch size when None)."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; expected one of {', '.join(SUITES)}")
    build, default_batch = SUITES[name]
    batch = default_batch if batch is None else batch
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return build(batch)
