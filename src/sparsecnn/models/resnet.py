"""ResNet-18/34/50 with torchvision's module names, and the CIFAR ResNet-18 of OptPrune.

Parameter names and shapes equal torchvision's (`conv1`, `bn1`, `layer1.0.conv1`,
`layer1.0.downsample.0`, `fc`, ...), so torchvision checkpoints load with `strict=True`.
Bottleneck strides on its 3x3 conv (ResNet v1.5), as torchvision does.
"""
from __future__ import annotations

from typing import List, Type, Union

import torch
from torch import Tensor, nn


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


def conv1x1(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(c_in, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(c_in, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


Block = Type[Union[BasicBlock, Bottleneck]]


class ResNet(nn.Module):
    """torchvision's ResNet. `cifar=True` swaps the stem for a 3x3 stride-1 conv with no maxpool
    (input 3x32x32); otherwise the input is 3x224x224 (any size >= 32 works)."""

    def __init__(self, block: Block, layers: List[int], num_classes: int = 1000, cifar: bool = False):
        super().__init__()
        if cifar:
            self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.c_in = 64
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, block: Block, width: int, n: int, stride: int = 1) -> nn.Sequential:
        c_out = width * block.expansion
        downsample = None
        if stride != 1 or self.c_in != c_out:
            downsample = nn.Sequential(conv1x1(self.c_in, c_out, stride), nn.BatchNorm2d(c_out))
        blocks = [block(self.c_in, width, stride, downsample)]
        self.c_in = c_out
        blocks += [block(c_out, width) for _ in range(1, n)]
        return nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18, input 3x224x224."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet34(num_classes: int = 1000) -> ResNet:
    """ResNet-34, input 3x224x224."""
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 (v1.5), input 3x224x224."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


def resnet18_cifar(num_classes: int = 10) -> ResNet:
    """ResNet-18 for CIFAR as in OptPrune: 3x3 stride-1 stem, no maxpool; input 3x32x32."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, cifar=True)
