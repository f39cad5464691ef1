"""`sparsify_`: swap a model's convolutions for `SparseConv2d` in place."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..autotune import pick_fastest
from ..autotune.select import candidates_for
from ..backends import get_backend
from .sparse_conv import SparseConv2d

FilterFn = Callable[[str, nn.Module], bool]


def _convs(model: nn.Module, filter_fn: Optional[FilterFn]) -> List[Tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.Conv1d, nn.Conv2d)) and (filter_fn is None or filter_fn(name, module))]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _layer_inputs(model: nn.Module, modules: Iterable[nn.Module], example_inputs) -> Dict[nn.Module, torch.Tensor]:
    """The first input each module sees when the model runs on `example_inputs`."""
    seen: Dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        seen.setdefault(module, args[0].detach())

    hooks = [module.register_forward_pre_hook(record) for module in modules]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _as_tuple(example_inputs) -> tuple:
    return example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def sparsify_(model: nn.Module, example_inputs=None, backend: str = "auto",
              filter_fn: Optional[FilterFn] = None, masks: Optional[Dict[str, torch.Tensor]] = None,
              backends: Optional[List[str]] = None) -> nn.Module:
    """Replace every Conv1d/Conv2d of `model` (selected by `filter_fn(name, module)`) by `SparseConv2d`.

    backend: a registered backend name, or "auto" to time every backend that supports each layer
    (restricted to `backends` when given; dense is always a candidate) on the layer's real input
    from running `model(*example_inputs)`, and keep the fastest. `masks` maps module names to bool
    masks; by default a weight's zeros are its pruned positions. Returns `model`, modified in place.
    """
    selected = _convs(model, filter_fn)
    if backend != "auto":
        get_backend(backend)
        for name, conv in selected:
            _replace(model, name, SparseConv2d.from_dense(conv, backend, _mask(masks, name)))
        return model
    if example_inputs is None:
        raise ValueError("backend='auto' needs example_inputs to time the candidates on")
    inputs = _layer_inputs(model, [conv for _, conv in selected], _as_tuple(example_inputs))
    for name, conv in selected:
        if conv not in inputs:
            continue  # never reached by this input: leave it untouched
        _replace(model, name, _tuned(conv, _mask(masks, name), inputs[conv], backends))
    return model


def _mask(masks: Optional[Dict[str, torch.Tensor]], name: str) -> Optional[torch.Tensor]:
    return None if masks is None else masks.get(name)


def _tuned(conv: nn.Module, mask: Optional[torch.Tensor], x: torch.Tensor,
           backends: Optional[List[str]]) -> SparseConv2d:
    layer = SparseConv2d.from_dense(conv, "dense", mask)
    spec = layer.spec_for(x)
    x4 = x.unsqueeze(2) if layer.conv_dims == 1 else x
    weight = layer._weight_4d().detach().contiguous()
    candidates = candidates_for(spec, x.dtype, x.device.type, backends)
    best, times = pick_fastest(x4, weight, layer.bias, spec, candidates)
    layer._set_backend(best.backend, best.config)
    layer.timings = times
    return layer
