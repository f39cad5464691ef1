"""Which layers a pruning method prunes, and the sparsity each of them is pruned to.

Default selection: every Conv1d/Conv2d and every Linear except the last Linear in
`named_modules()` order (the classifier, which holds few weights and whose pruning costs the most
accuracy). For lenet5 that is conv1, conv2, fc1; for alexnet-cifar conv1, conv2, conv3.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple, Union

from torch import nn

from sparsecnn.prune.magnitude import _check_sparsity, prunable_layers

# One fraction of zero weights for every pruned layer, or {module path: fraction}.
SparsityTarget = Union[float, Mapping[str, float]]


def pruned_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of the layers pruned by default: convs and all Linears but the last."""
    layers = prunable_layers(model, include_linear=True)
    linears = [name for name, module in layers if isinstance(module, nn.Linear)]
    classifier = linears[-1] if linears else None
    return [(name, module) for name, module in layers if name != classifier]


def layer_sparsities(model: nn.Module, sparsity: SparsityTarget) -> Dict[str, float]:
    """{module path: sparsity in [0, 1]}: one float applies to every `pruned_layers` layer; a mapping
    names its own layers (any Conv1d/Conv2d/Linear of `model`) and only those are pruned."""
    if not isinstance(sparsity, Mapping):
        target = _check_sparsity(sparsity)
        return {name: target for name, _ in pruned_layers(model)}
    weighted = {name for name, _ in prunable_layers(model, include_linear=True)}
    unknown = sorted(set(sparsity) - weighted)
    if unknown:
        raise ValueError(f"sparsity names {', '.join(unknown)}, which are not conv or linear layers of the model")
    return {name: _check_sparsity(value) for name, value in sparsity.items()}
