"""Unstructured magnitude pruning, and masks from models pruned elsewhere.

Contract with the kernels: a pruned layer keeps a dense `weight` holding exact zeros;
its mask (same shape, `torch.bool`, True where the weight may be non-zero) travels
beside it in a `dict[str, torch.Tensor]` keyed by module path (`model.named_modules()`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

FilterFn = Callable[[str, nn.Module], bool]
Masks = Dict[str, torch.Tensor]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d)


def _check_sparsity(sparsity: float) -> float:
    sparsity = float(sparsity)
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    return sparsity


def _keep_count(numel: int, sparsity: float) -> int:
    """Number of weights kept out of `numel` at `sparsity` (rounded to nearest)."""
    return round((1.0 - _check_sparsity(sparsity)) * numel)


def _top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask, shape of `scores`, True at the `k` largest entries.

    Ties are broken by flat index (earlier wins) through a stable sort, so the mask is
    deterministic and exactly `k` entries are set.
    """
    flat = scores.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    mask[order[:k]] = True
    return mask.reshape(scores.shape)


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Mask keeping the round((1 - sparsity) * numel) largest |weight| entries.

    weight: any shape, floating dtype. Returns a `torch.bool` tensor of the same shape
    and device whose count of True entries is exactly that number.
    """
    return _top_k_mask(weight.detach().abs(), _keep_count(weight.numel(), sparsity))


def prunable_layers(
    model: nn.Module, filter_fn: Optional[FilterFn] = None, include_linear: bool = False
) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every Conv1d/Conv2d (and Linear if asked) accepted by `filter_fn`,
    in `model.named_modules()` order."""
    types = _CONV_TYPES + ((nn.Linear,) if include_linear else ())
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, types) and (filter_fn is None or filter_fn(name, module))
    ]


def _global_masks(weights: Dict[str, torch.Tensor], sparsity: float) -> Masks:
    """One magnitude ranking across all `weights`; exactly round((1-s)*total) kept."""
    scores = torch.cat([w.detach().abs().reshape(-1).float() for w in weights.values()])
    flat = _top_k_mask(scores, _keep_count(scores.numel(), sparsity))
    chunks = torch.split(flat, [w.numel() for w in weights.values()])
    return {
        name: chunk.reshape(w.shape).to(w.device)
        for (name, w), chunk in zip(weights.items(), chunks)
    }


@torch.no_grad()
def prune_magnitude_(
    model: nn.Module,
    sparsity: float,
    scope: str = "layer",
    filter_fn: Optional[FilterFn] = None,
    *,
    include_linear: bool = False,
) -> Masks:
    """Zero the smallest-magnitude weights of the selected layers in place.

    scope="layer": every selected layer is pruned to `sparsity` on its own.
    scope="global": one ranking over all selected layers; the total number kept is exact
    and per-layer sparsities differ. Selection: Conv1d/Conv2d (plus Linear with
    `include_linear=True`) for which `filter_fn(name, module)` is true.
    Returns {module path: bool mask shaped like its weight}.
    """
    _check_sparsity(sparsity)
    layers = prunable_layers(model, filter_fn, include_linear)
    for name, module in layers:
        if hasattr(module, "weight_orig"):
            raise ValueError(
                f"layer {name!r} is pruned with torch.nn.utils.prune; "
                "call absorb_torch_prune_(model) first"
            )
    weights = {name: module.weight for name, module in layers}
    if scope == "layer":
        masks = {name: magnitude_mask(w, sparsity) for name, w in weights.items()}
    elif scope == "global":
        masks = _global_masks(weights, sparsity) if weights else {}
    else:
        raise ValueError(f"scope must be 'layer' or 'global', got {scope!r}")
    for name, mask in masks.items():
        weights[name].mul_(mask)
    return masks


@torch.no_grad()
def absorb_torch_prune_(model: nn.Module) -> Masks:
    """Make `torch.nn.utils.prune` pruning of `weight` permanent and return its masks.

    Every module holding `weight_orig` and `weight_mask` gets a plain `weight` parameter
    with exact zeros (`torch.nn.utils.prune.remove`). Returns {module path: bool mask}.
    """
    masks = {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_orig") and hasattr(module, "weight_mask"):
            masks[name] = module.weight_mask.detach().to(torch.bool)
            torch_prune.remove(module, "weight")
    return masks


def masks_from_weights(
    model: nn.Module, filter_fn: Optional[FilterFn] = None, *, include_linear: bool = False
) -> Masks:
    """{module path: weight != 0} for the conv (and, if asked, Linear) layers selected."""
    return {
        name: module.weight.detach() != 0
        for name, module in prunable_layers(model, filter_fn, include_linear)
    }
