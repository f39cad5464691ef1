"""VGG-16 with torchvision's module names, and a CIFAR-10 VGG-16 sharing its `features`.

`features.N` / `classifier.N` indices equal torchvision's `vgg16` (no batch norm), so torchvision
checkpoints load with `strict=True`.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

# Output channels of each 3x3 conv; "M" is a 2x2 stride-2 maxpool.
VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def make_features(cfg: list) -> nn.Sequential:
    layers: list[nn.Module] = []
    c_in = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
        else:
            layers += [nn.Conv2d(c_in, v, 3, padding=1), nn.ReLU(inplace=True)]
            c_in = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """`features`, then `avgpool` to `pool` x `pool`, flatten, `classifier`."""

    def __init__(self, features: nn.Sequential, pool: int, classifier: nn.Sequential):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(num_classes: int = 1000) -> VGG:
    """torchvision VGG-16, input 3x224x224: 13 convs, avgpool to 7x7, 25088 -> 4096 -> 4096 -> classes
    with ReLU and Dropout(0.5) after each hidden Linear (classifier.0, .3, .6 are the Linears)."""
    classifier = nn.Sequential(
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, num_classes),
    )
    return VGG(make_features(VGG16_CFG), 7, classifier)


def vgg16_cifar(num_classes: int = 10) -> VGG:
    """VGG-16 for CIFAR-10, input 3x32x32: torchvision's `features` (ending at 512x1x1), avgpool to
    1x1, and a single Linear 512 -> classes named `classifier.0`."""
    return VGG(make_features(VGG16_CFG), 1, nn.Sequential(nn.Linear(512, num_classes)))
