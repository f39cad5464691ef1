"""A ResNet block's end with a projection shortcut, small, for the shortcut-folding tests."""
import torch
from torch import nn

from helpers.common import sparse_weight


class Block(nn.Module):
    """A ResNet bottleneck's end: relu(bn(conv2(relu(bn(conv1(x))))) + bn(downsample(x)))."""

    def __init__(self, c=8, mid=16, k=32, stride=2):
        super().__init__()
        self.conv1 = nn.Conv2d(c, mid, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, k, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(k)
        self.downsample = nn.Sequential(nn.Conv2d(c, k, 1, stride, bias=False), nn.BatchNorm2d(k))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.downsample(x))


def block_model(c=8, mid=16, k=32, stride=2):
    torch.manual_seed(0)
    model = nn.Sequential(Block(c, mid, k, stride), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.weight.data = sparse_weight(module.weight.shape, 0.5)
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.2, 0.2)
    return model.eval()


def block_inputs(c=8, h=9):
    return torch.randn(2, c, h, h) + 0.1
