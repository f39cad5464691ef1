"""The two small networks of paper 002: Caffe's MNIST LeNet and the cuda-convnet CIFAR-10 net."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LeNet5(nn.Module):
    """Caffe LeNet, input 1x28x28: conv1 1->20 5x5 (24x24), maxpool 2 (12x12), conv2 20->50 5x5
    (8x8), maxpool 2 (4x4), fc1 800->500, ReLU, fc2 500->classes. As in Caffe, no ReLU after the convs."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(50 * 4 * 4, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(self.conv1(x), 2)
        x = F.max_pool2d(self.conv2(x), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class AlexNetCifar(nn.Module):
    """cuda-convnet / Caffe `cifar10_full` net, input 3x32x32:
    conv1 3->32 5x5 pad 2 (32x32), maxpool 3/2, ReLU (16x16);
    conv2 32->32 5x5 pad 2, ReLU, avgpool 3/2 (8x8);
    conv3 32->64 5x5 pad 2, ReLU, avgpool 3/2 (4x4); fc 1024->classes.
    Pools use ceil_mode=True, which reproduces Caffe's output sizes; the LRN layers are left out.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 32, 5, padding=2)
        self.conv3 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc = nn.Linear(64 * 4 * 4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 3, 2, ceil_mode=True))
        x = F.avg_pool2d(F.relu(self.conv2(x)), 3, 2, ceil_mode=True)
        x = F.avg_pool2d(F.relu(self.conv3(x)), 3, 2, ceil_mode=True)
        return self.fc(torch.flatten(x, 1))


def lenet5(num_classes: int = 10) -> LeNet5:
    """LeNet-5, input 1x28x28."""
    return LeNet5(num_classes)


def alexnet_cifar(num_classes: int = 10) -> AlexNetCifar:
    """CIFAR-10 "AlexNet" of paper 002, input 3x32x32."""
    return AlexNetCifar(num_classes)
