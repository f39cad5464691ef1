"""Our models' forward passes against torchvision's, an independent implementation: the same state
dict loaded into both (`strict=True`: the names and shapes are torchvision's), both run in float64
in eval mode on the same random input. A structural slip that keeps every parameter's name and
shape (a missing residual add, a lost ReLU, a pool in the wrong place, a 5x5 branch for a 3x3 one)
changes the output by O(1), far outside 1e-10.

GPU machine only (`gpu` marker): torchvision is in the GPU image, not in the CPU CI requirements,
and fp64 forward passes of ResNet-50 / VGG-16 at 224x224 take seconds there, minutes on two CPU cores.

Covered: resnet18, resnet34, resnet50, vgg16, googlenet (torchvision's own constructors), and
resnet18-cifar (torchvision's resnet18 with the stem it documents swapped in: a 3x3 stride-1 conv
and no maxpool; every residual block is torchvision's). Left out: vgg16-cifar (its `features` are
vgg16's, covered above; its 1x1 avgpool and single-Linear classifier have no torchvision twin),
lenet5 and alexnet-cifar (no torchvision twin).
"""
import importlib.util

import pytest
import torch
from helpers.common import GPU_SKIP
from torch import nn

from sparsecnn.core.reference import relative_error
from sparsecnn.models import build_model, default_input_shape

TOLERANCE = 1e-10  # fp64, the same ops in the same order: the outputs agree to rounding


def _torchvision_twin(name: str) -> nn.Module:
    """torchvision's model for our `name`, randomly initialised (its weights are replaced)."""
    from torchvision import models

    if name == "googlenet":
        return models.googlenet(weights=None, aux_logits=False, transform_input=False, init_weights=False)
    if name == "resnet18-cifar":
        model = models.resnet18(weights=None, num_classes=10)
        model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model
    return getattr(models, name)(weights=None)


def _randomise_batchnorms_(model: nn.Module, generator: torch.Generator) -> None:
    """Running statistics and affine parameters away from BatchNorm's init (mean 0, var 1, identity
    affine), so that every BatchNorm changes its input and a misplaced one shows."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                c = module.num_features
                module.running_mean.copy_(0.1 * torch.randn(c, generator=generator))
                module.running_var.copy_(0.5 + torch.rand(c, generator=generator))
                module.weight.copy_(0.5 + torch.rand(c, generator=generator))
                module.bias.copy_(0.1 * torch.randn(c, generator=generator))


def forward_both(name: str, device, batch: int = 2, hw=None):
    """(our output, torchvision's) for `batch` random images of `hw` (default: the model's input
    size), both models in float64 eval mode on `device` with our randomly initialised state dict."""
    generator = torch.Generator().manual_seed(0)
    ours = build_model(name).eval()
    _randomise_batchnorms_(ours, generator)
    theirs = _torchvision_twin(name).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    c, h, w = default_input_shape(name)
    h, w = hw or (h, w)
    x = torch.randn(batch, c, h, w, generator=generator, dtype=torch.float64).to(device)
    with torch.no_grad():
        return ours.double().to(device)(x), theirs.double().to(device)(x)


def _require_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    if torch.cuda.is_available():  # the GPU image ships torchvision: missing there is a broken image
        pytest.fail("torchvision is missing on a CUDA machine: the GPU image ships it (pip install torchvision)",
                    pytrace=False)
    pytest.skip(f"{GPU_SKIP} machine, where torchvision is installed (CPU CI does not install it)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet18", "resnet34", "resnet50", "vgg16", "googlenet", "resnet18-cifar"])
def test_gpu_forward_matches_torchvision_in_fp64(name):
    _require_torchvision()
    ours, theirs = forward_both(name, "cuda")
    assert ours.dtype == theirs.dtype == torch.float64 and ours.shape == theirs.shape
    assert torch.isfinite(theirs).all() and theirs.abs().max() > 0
    assert relative_error(ours, theirs) < TOLERANCE
