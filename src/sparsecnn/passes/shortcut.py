"""Fold a projection shortcut into the conv that takes its output as residual (`nn.shortcut`).

After `prepare_for_inference`, ResNet's first block of each stage ends in
`conv3(y, residual=downsample(x))` with ReLU fused. `fold_shortcut` makes it
`conv3(y, shortcut_input=x)`, the downsample `SparseConv2d` moved from its path to `conv3.shortcut`;
`unfold_shortcut` puts it back. Tuning folds a pair only where the whole model gets faster
(`tuning.whole_model.fold_shortcuts`).
"""
from __future__ import annotations

from typing import List, Tuple

from torch import fx

from sparsecnn.nn.shortcut import fold_blocker
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.passes.graph import called_module, module_calls


def shortcut_pairs(gm: fx.GraphModule) -> List[Tuple[str, str]]:
    """(conv, shortcut conv) module paths of every `conv(y, residual=shortcut(x))` in graph order
    where the shortcut's output has no other use, neither module is called elsewhere and
    `nn.shortcut.fold_blocker` allows the fold."""
    calls = module_calls(gm)
    pairs = []
    for node in gm.graph.nodes:
        layer = called_module(gm, node)
        if not isinstance(layer, SparseConv2d) or len(node.args) != 1 or set(node.kwargs) != {"residual"}:
            continue
        residual = node.kwargs["residual"]
        shortcut = called_module(gm, residual)
        if (isinstance(shortcut, SparseConv2d) and len(residual.users) == 1 and len(residual.args) == 1
                and not residual.kwargs and calls[node.target] == 1 and calls[residual.target] == 1
                and fold_blocker(layer, shortcut) is None):
            pairs.append((node.target, residual.target))
    return pairs


def _call_node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(node for node in gm.graph.nodes if node.op == "call_module" and node.target == name)


def fold_shortcut(gm: fx.GraphModule, name: str, shortcut_name: str) -> None:
    """Make the pair (`name`, `shortcut_name`) of `shortcut_pairs` one layer; in place."""
    node = _call_node(gm, name)
    residual = node.kwargs["residual"]
    if residual.op != "call_module" or residual.target != shortcut_name:
        raise ValueError(f"{name} does not take {shortcut_name}'s output as its residual")
    shortcut = gm.get_submodule(shortcut_name)
    node.kwargs = {"shortcut_input": residual.args[0]}
    gm.graph.erase_node(residual)
    gm.delete_submodule(shortcut_name)
    gm.get_submodule(name).shortcut = shortcut
    gm.recompile()


def unfold_shortcut(gm: fx.GraphModule, name: str, shortcut_name: str) -> None:
    """Undo `fold_shortcut(gm, name, shortcut_name)`; in place."""
    layer = gm.get_submodule(name)
    node = _call_node(gm, name)
    shortcut, x = layer.shortcut, node.kwargs["shortcut_input"]
    layer.shortcut = None
    gm.add_submodule(shortcut_name, shortcut)
    with gm.graph.inserting_before(node):
        restored = gm.graph.call_module(shortcut_name, (x,))
    node.kwargs = {"residual": restored}
    gm.recompile()
