"""Tuning of `nn.SplitKLinear`: each layer's split chosen by timing on the input it sees.

`tune_linears` (run by `autotune_model`) times each SplitKLinear that sees a CUDA fp32 2-D input with
every split of `split_candidates` against F.linear and keeps the fastest: a layer is never slower
than F.linear as measured.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sparsecnn.nn.linear import SplitKLinear, split_candidates, split_k_linear
from sparsecnn.tuning.select import Candidate, Timer


def _may_tune(layer: SplitKLinear) -> bool:
    """Whether `layer` could be timed: a CUDA fp32 weight and a split to try. Only fp32, the precision
    measured: in 16-bit dtypes bmm rounds each partial product before the sum."""
    return layer.weight.is_cuda and layer.weight.dtype == torch.float32 and len(split_candidates(layer.in_features)) > 1


def _tunable(layer: SplitKLinear, x: torch.Tensor) -> bool:
    """Whether `layer` is timed on `x`: a CUDA fp32 2-D input of a layer that `_may_tune`."""
    return _may_tune(layer) and x.is_cuda and x.dim() == 2 and x.dtype == torch.float32


def time_splits(name: str, layer: SplitKLinear, x: torch.Tensor, timer: Timer) -> Dict[str, Any]:
    """Time `layer` on `x` (M, in_features) with each of `split_candidates` (`timer.measure`, candidate
    label "linear:<name>[<splits>]"), set `layer.splits` to the fastest (1 on ties) and return
    {"splits", "ms" (its median ms), "dense_ms" (F.linear's)}."""
    weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    times = {}
    for splits in split_candidates(layer.in_features):
        run = ((lambda: F.linear(x, weight, bias)) if splits == 1
               else (lambda s=splits: split_k_linear(x, weight, bias, s)))
        times[splits] = timer.measure(Candidate(f"linear:{name}", splits), run)
    layer.splits = min(times, key=times.get)
    return {"splits": layer.splits, "ms": times[layer.splits], "dense_ms": times[1]}


def tune_linears(model: nn.Module, inputs: tuple, timer: Timer) -> Tuple[Dict[str, Dict[str, Any]], Any]:
    """Choose `splits` for each `SplitKLinear` of `model` on the input it sees; in place.

    When some SplitKLinear `_may_tune` (CUDA fp32 weight), runs `model(*inputs)` once (call it under
    torch.no_grad) with a pre-hook that, before a layer's first call on a CUDA fp32 2-D input with a
    split to try, times it there (`time_splits`); the layer then runs its choice, so the output is the
    tuned model's. Other layers (CPU, other dtypes or ranks, small in_features) keep their splits
    and nothing is timed for them. Returns ({module path: {"splits", "ms", "dense_ms"}} of the timed
    layers in call order, the pass's output or None when it did not run)."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, SplitKLinear)}
    if not any(_may_tune(layer) for layer in layers.values()):
        return {}, None
    results: Dict[str, Dict[str, Any]] = {}
    seen = set()

    def hook_for(name: str):
        def tune_before_first_call(layer: SplitKLinear, args: tuple) -> None:
            if name not in seen and _tunable(layer, args[0]):
                results[name] = time_splits(name, layer, args[0], timer)
            seen.add(name)

        return tune_before_first_call

    hooks = [layer.register_forward_pre_hook(hook_for(name)) for name, layer in layers.items()]
    try:
        return results, model(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
