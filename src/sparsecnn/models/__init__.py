"""CNN definitions with torchvision-compatible parameter names, looked up by name."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from sparsecnn.models.googlenet import googlenet
from sparsecnn.models.resnet import resnet18, resnet18_cifar, resnet34, resnet50
from sparsecnn.models.small import alexnet_cifar, lenet5
from sparsecnn.models.vgg import vgg16, vgg16_cifar

# name -> (constructor taking num_classes, input shape (C, H, W))
_MODELS: Dict[str, Tuple[Callable[..., nn.Module], Tuple[int, int, int]]] = {
    "resnet18": (resnet18, (3, 224, 224)),
    "resnet34": (resnet34, (3, 224, 224)),
    "resnet50": (resnet50, (3, 224, 224)),
    "resnet18-cifar": (resnet18_cifar, (3, 32, 32)),
    "vgg16": (vgg16, (3, 224, 224)),
    "vgg16-cifar": (vgg16_cifar, (3, 32, 32)),
    "googlenet": (googlenet, (3, 224, 224)),
    "lenet5": (lenet5, (1, 28, 28)),
    "alexnet-cifar": (alexnet_cifar, (3, 32, 32)),
}
MODEL_NAMES: Tuple[str, ...] = tuple(_MODELS)


def _entry(name: str):
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    return _MODELS[name]


def build_model(name: str, num_classes: int | None = None) -> nn.Module:
    """Model `name` with `num_classes` outputs (its dataset's count when None), randomly initialised."""
    build = _entry(name)[0]
    return build() if num_classes is None else build(num_classes)


class _SkipInit(TorchFunctionMode):
    """Makes the in-place value-filling ops of weight initialisation no-ops: the values are to be
    replaced anyway, and random fills of a large model take a second."""

    _FILLING = frozenset({"normal_", "uniform_", "fill_", "zero_", "erfinv_", "mul_", "add_", "clamp_", "copy_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if getattr(func, "__name__", None) in self._FILLING and isinstance(target, torch.Tensor):
            return target
        return func(*args, **(kwargs or {}))


def build_skeleton(name: str, num_classes: int | None = None) -> nn.Module:
    """Model `name` (as `build_model`) on the CPU with uninitialised parameters and buffers (any
    values, NaN included): a structure to load parameters into. Not on the meta device: meta
    tensors' ops import torch._dynamo on first use, seconds in a fresh process."""
    with _SkipInit():
        return build_model(name, num_classes)


def default_input_shape(name: str) -> Tuple[int, int, int]:
    """The (C, H, W) input model `name` is defined for."""
    return _entry(name)[1]


__all__ = ["MODEL_NAMES", "build_model", "build_skeleton", "default_input_shape"]
