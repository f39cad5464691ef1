"""torchvision's GoogLeNet (Inception v1) with aux_logits=False and transform_input=False.

Module names and shapes equal torchvision's (`conv1.conv`, `conv1.bn`, `inception3a.branch2.0.conv`,
..., `fc`). Like torchvision, branch3 uses a 3x3 conv where the paper has 5x5
(pytorch/vision#906), and every maxpool uses ceil_mode=True.

torchvision's checkpoint file also holds `aux1.*`/`aux2.*`: drop those keys before loading with
`strict=True`. Its pretrained weights expect transform_input=True, i.e. inputs normalised to [-1, 1]
per channel rather than with the ImageNet mean/std; that preprocessing is left to the caller.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BasicConv2d(nn.Module):
    """conv (no bias) + BatchNorm(eps=1e-3) + ReLU."""

    def __init__(self, c_in: int, c_out: int, **kwargs):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(c_out, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class Inception(nn.Module):
    def __init__(self, c_in: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int,
                 pool_proj: int):
        super().__init__()
        self.branch1 = BasicConv2d(c_in, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(
            BasicConv2d(c_in, ch3x3red, kernel_size=1),
            BasicConv2d(ch3x3red, ch3x3, kernel_size=3, padding=1),
        )
        self.branch3 = nn.Sequential(
            BasicConv2d(c_in, ch5x5red, kernel_size=1),
            BasicConv2d(ch5x5red, ch5x5, kernel_size=3, padding=1),  # 3x3, as torchvision
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True),
            BasicConv2d(c_in, pool_proj, kernel_size=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    """Input 3x224x224 -> logits (N, num_classes)."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = BasicConv2d(3, 64, kernel_size=7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = BasicConv2d(64, 64, kernel_size=1)
        self.conv3 = BasicConv2d(64, 192, kernel_size=3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.inception3a = Inception(192, 64, 96, 128, 16, 32, 32)
        self.inception3b = Inception(256, 128, 128, 192, 32, 96, 64)
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.inception4a = Inception(480, 192, 96, 208, 16, 48, 64)
        self.inception4b = Inception(512, 160, 112, 224, 24, 64, 64)
        self.inception4c = Inception(512, 128, 128, 256, 24, 64, 64)
        self.inception4d = Inception(512, 112, 144, 288, 32, 64, 64)
        self.inception4e = Inception(528, 256, 160, 320, 32, 128, 128)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)

        self.inception5a = Inception(832, 256, 160, 320, 32, 128, 128)
        self.inception5b = Inception(832, 384, 192, 384, 48, 128, 128)

        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool1(self.conv1(x))  # 64 x 56 x 56
        x = self.maxpool2(self.conv3(self.conv2(x)))  # 192 x 28 x 28
        x = self.maxpool3(self.inception3b(self.inception3a(x)))  # 480 x 14 x 14
        x = self.inception4c(self.inception4b(self.inception4a(x)))
        x = self.maxpool4(self.inception4e(self.inception4d(x)))  # 832 x 7 x 7
        x = self.inception5b(self.inception5a(x))  # 1024 x 7 x 7
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


def googlenet(num_classes: int = 1000) -> GoogLeNet:
    """GoogLeNet, input 3x224x224."""
    return GoogLeNet(num_classes)
