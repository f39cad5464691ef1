"""Sibling convolutions merged into one: convs that read the same tensor with the same geometry.

Why. An inception block (GoogLeNet) runs three 1x1 convs on its input, each a small kernel.
Merged, GoogLeNet has 39 conv layers instead of 57: fewer launches per eager forward, fewer layers
to tune. What it does not change much is the GPU time under CUDA graphs, although the merged
layers' tuned times (each timed alone after an L2 flush) sum to less than the siblings': in the
model the second and third siblings find the input in L2, so reading it once saves little.
Its output's channel slices `y[:, a:b]` replace the siblings' outputs (views: NCHW slices are
strided, batch-innermost ones are dense, so `layout` keeps that layout through them).

Which. `SparseConv2d` layers on the "dense" backend (not yet tuned), each called once with the
same input node as its only argument and no residual or pool, 2-D, groups 1, with equal kernel
size, input channels, stride, padding, dilation, activation, bias presence, weight dtype and
device. The merged layer's weight, mask and bias are the siblings' concatenated in graph order;
it is registered under the siblings' common parent as `merged__<their paths below it>`.
"""
from __future__ import annotations

import operator
import os
from typing import Dict, List

import torch
from torch import fx

from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.passes.graph import called_module, module_calls


def _sibling_key(gm: fx.GraphModule, node: fx.Node, calls) -> tuple:
    """What siblings must share to merge; () when `node` cannot merge at all."""
    layer = called_module(gm, node)
    if not (isinstance(layer, SparseConv2d) and calls[node.target] == 1 and len(node.args) == 1
            and isinstance(node.args[0], fx.Node) and not node.kwargs):
        return ()
    if (layer.backend != "dense" or layer.conv_dims != 2 or layer.groups != 1 or layer.pool is not None
            or layer.takes_residual):
        return ()
    return (node.args[0], tuple(layer.weight.shape[1:]), layer.stride, layer.padding, layer.dilation,
            layer.activation, layer.bias is None, layer.weight.dtype, layer.weight.device)


def _merged_layer(layers: List[SparseConv2d]) -> SparseConv2d:
    first = layers[0]
    bias = None if first.bias is None else torch.cat([layer.bias.detach() for layer in layers])
    return SparseConv2d(torch.cat([layer.weight.detach() for layer in layers]), bias,
                        torch.cat([layer.mask for layer in layers]), first.stride, first.padding, first.dilation,
                        activation=first.activation)


def _merged_path(paths: List[str]) -> str:
    """`parent.merged__a_b__c_d` for siblings `parent.a.b` and `parent.c.d`."""
    parts = [path.split(".") for path in paths]
    common = os.path.commonprefix(parts)[:min(len(p) for p in parts) - 1]
    leaf = "merged__" + "__".join("_".join(p[len(common):]) for p in parts)
    return ".".join([*common, leaf])


def merge_sibling_convs(gm: fx.GraphModule) -> Dict[str, List[str]]:
    """Merge every group of two or more sibling convs (see the module docstring) in place.

    Returns {merged layer's path: the siblings' paths, in output-channel order}."""
    calls, groups = module_calls(gm), {}
    for node in gm.graph.nodes:
        key = _sibling_key(gm, node, calls)
        if key:
            groups.setdefault(key, []).append(node)
    merged = {}
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        paths = [node.target for node in nodes]
        layers = [gm.get_submodule(path) for path in paths]
        name = _merged_path(paths)
        gm.add_submodule(name, _merged_layer(layers))
        with gm.graph.inserting_before(nodes[0]):
            merged_node = gm.graph.call_module(name, nodes[0].args)
        start = 0
        for node, layer in zip(nodes, layers):
            end = start + layer.out_channels
            with gm.graph.inserting_before(node):
                piece = gm.graph.call_function(operator.getitem, (merged_node, (slice(None), slice(start, end))))
            node.replace_all_uses_with(piece)
            gm.graph.erase_node(node)
            start = end
        merged[name] = paths
    return merged
