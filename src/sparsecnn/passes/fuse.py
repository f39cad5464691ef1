"""Inference graph simplification with torch.fx.

`fold_batchnorm` folds each eval-mode BatchNorm into the conv before it. `prepare_for_inference` also
swaps every conv for a `SparseConv2d` (backend "dense") and fuses the ReLU and residual add that
follow it into the layer's epilogue (`activation="relu"`, `forward(x, residual=...)`), so a sparse
backend can apply them while its output tile is still in registers, and swaps max pools for
`pool.MaxPool2d` / `pool.max_pool2d` (no argmax; the input's layout kept), channel
concatenations for `concat.cat_channels` (a batch-innermost layout kept) and linears for
`linear.SplitKLinear` (split-K GEMMs where `autotune_model` finds them faster), and merges sibling
convs that read the same input (`merge.py`).
"""
from __future__ import annotations

import copy
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn

from sparsecnn.core.pool_args import PoolArgs
from sparsecnn.nn.concat import cat_channels
from sparsecnn.nn.linear import SplitKLinear
from sparsecnn.nn.pool import MaxPool2d, max_pool2d
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.passes.graph import called_module, module_calls
from sparsecnn.passes.merge import merge_sibling_convs
from sparsecnn.passes.residual_bias import move_residual_biases
from sparsecnn.prune import absorb_torch_prune_

Masks = Dict[str, torch.Tensor]

_BATCHNORM_OF = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d}
_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_)
_RELU_METHODS = ("relu", "relu_")
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_ADD_METHODS = ("add", "add_")
_INPLACE_ADDS = (operator.iadd, "add_")


@dataclass
class FuseReport:
    """What the graph passes changed; every name is a conv's module path in the original model."""

    folded_batchnorms: Dict[str, str] = field(default_factory=dict)  # conv -> BatchNorm folded into it
    fused_relus: List[str] = field(default_factory=list)  # convs that now end in activation="relu"
    fused_adds: List[str] = field(default_factory=list)  # convs that now take the residual add
    swapped_pools: List[str] = field(default_factory=list)  # MaxPool2d paths and F.max_pool2d node names
    swapped_concats: List[str] = field(default_factory=list)  # torch.cat node names (dim 1)
    swapped_linears: List[str] = field(default_factory=list)  # nn.Linear paths, now SplitKLinear
    fused_pools: List[str] = field(default_factory=list)  # convs that now end in their max pool
    merged_convs: Dict[str, List[str]] = field(default_factory=dict)  # merged conv -> sibling convs in it
    moved_biases: Dict[str, str] = field(default_factory=dict)  # conv -> conv taking its output as residual and its bias

    def summary(self) -> str:
        return (f"{len(self.folded_batchnorms)} BatchNorms folded, {len(self.fused_relus)} ReLUs and "
                f"{len(self.fused_adds)} residual adds fused, {len(self.swapped_pools)} max pools, "
                f"{len(self.swapped_linears)} linears and {len(self.swapped_concats)} concatenations swapped, "
                f"{len(self.fused_pools)} max pools moved into their convs, "
                f"{sum(map(len, self.merged_convs.values()))} sibling convs merged into {len(self.merged_convs)}, "
                f"{len(self.moved_biases)} residual convs' biases moved into their consumers")


class _Tracer(fx.Tracer):
    """Keeps `SparseConv2d` and `SplitKLinear` leaves, so models that already hold some trace too."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, (SparseConv2d, SplitKLinear)) or super().is_leaf_module(module, qualified_name)


def _inference_copy(model: nn.Module) -> tuple[nn.Module, Masks]:
    """An eval-mode deep copy of `model` with `torch.nn.utils.prune` made permanent, and its masks."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    # A pruned `weight` is a non-leaf tensor, which deepcopy refuses; the copy recomputes it anyway.
    memo = {id(module.weight): module.weight.detach()
            for module in model.modules() if hasattr(module, "weight_orig")}
    model = copy.deepcopy(model, memo).eval()
    return model, absorb_torch_prune_(model)


def _trace(model: nn.Module) -> fx.GraphModule:
    try:
        graph = _Tracer().trace(model)
    except Exception as error:  # tracing failures come as TraceError, TypeError, RuntimeError, ...
        raise ValueError(f"model must be traceable by torch.fx; tracing {type(model).__name__} failed: "
                         f"{error}") from error
    return fx.GraphModule(model, graph, type(model).__name__)


@torch.no_grad()
def _fold_into(conv: nn.Module, bn: nn.Module) -> None:
    """conv.weight *= s and conv.bias = beta + (bias - mean) * s per output channel, with
    s = gamma / sqrt(running_var + eps) in float64; the weight is scaled in at least float32 (one
    rounding per element) and both are stored in the weight's dtype."""
    mean, var = bn.running_mean.double(), bn.running_var.double()
    gamma = torch.ones_like(var) if bn.weight is None else bn.weight.double()
    beta = torch.zeros_like(var) if bn.bias is None else bn.bias.double()
    bias = torch.zeros_like(mean) if conv.bias is None else conv.bias.double()
    scale = gamma / torch.sqrt(var + bn.eps)
    dtype = conv.weight.dtype
    compute = torch.promote_types(dtype, torch.float32)
    weight = conv.weight.to(compute) * scale.to(compute).reshape(-1, *[1] * (conv.weight.dim() - 1))
    conv.weight = nn.Parameter(weight.to(dtype))
    conv.bias = nn.Parameter((beta + (bias - mean) * scale).to(dtype))


def _fold_batchnorms(gm: fx.GraphModule) -> Dict[str, str]:
    """Fold every eval-mode BatchNorm whose input is a conv output used by nothing else."""
    calls, folded = module_calls(gm), {}
    for bn_node in list(gm.graph.nodes):
        bn = called_module(gm, bn_node)
        if bn is None or len(bn_node.args) != 1 or bn_node.kwargs:
            continue
        conv_node = bn_node.args[0]
        conv = called_module(gm, conv_node)
        if (conv is None or type(bn) is not _BATCHNORM_OF.get(type(conv)) or bn.running_mean is None
                or len(conv_node.users) != 1 or calls[conv_node.target] != 1):
            continue
        _fold_into(conv, bn)
        bn_node.replace_all_uses_with(conv_node)
        gm.graph.erase_node(bn_node)
        folded[conv_node.target] = bn_node.target
    return folded


def _finish(gm: fx.GraphModule, report: FuseReport) -> fx.GraphModule:
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.fuse_report = report
    return gm.eval()


def fold_batchnorm(model: nn.Module) -> fx.GraphModule:
    """`model` traced by torch.fx in eval mode, every BatchNorm1d/2d that follows a Conv1d/Conv2d folded
    into the conv's weight and bias (per output channel, so pruned zeros stay zeros).

    A BatchNorm is folded when its input is the output of a conv called once and used by nothing else,
    and it has running statistics. `torch.nn.utils.prune` reparametrisations are made permanent first.
    `model` is not modified. The result's `fuse_report` (a `FuseReport`) lists the folds.
    """
    model, _ = _inference_copy(model)
    gm = _trace(model)
    return _finish(gm, FuseReport(folded_batchnorms=_fold_batchnorms(gm)))


def _conv_masks(gm: fx.GraphModule, masks: Masks, pruned: Masks) -> Masks:
    """{conv path: bool mask} for every Conv1d/Conv2d the graph calls: `masks[path]` if given, else
    the `torch.nn.utils.prune` mask, else the weight's non-zeros (taken before any BatchNorm fold)."""
    found = {}
    for node in gm.graph.nodes:
        conv = called_module(gm, node)
        if type(conv) in _BATCHNORM_OF:
            mask = masks.get(node.target, pruned.get(node.target))
            found[node.target] = conv.weight.detach() != 0 if mask is None else mask
    return found


def _to_sparse(gm: fx.GraphModule, masks: Masks) -> None:
    for name, mask in masks.items():
        try:
            layer = SparseConv2d.from_dense(gm.get_submodule(name), "dense", mask)
        except ValueError as error:
            raise ValueError(f"conv {name!r} cannot become a SparseConv2d: {error}") from error
        parent, _, child = name.rpartition(".")
        setattr(gm.get_submodule(parent), child, layer)


def _sole_conv(gm: fx.GraphModule, node, calls: Counter, *, residual_allowed: bool) -> Optional[SparseConv2d]:
    """The `SparseConv2d` that `node` calls, when that module is called only there, `node`'s output
    has one use and no argument but the input (and the residual, if allowed); else None."""
    layer = called_module(gm, node)
    sole = (isinstance(layer, SparseConv2d) and calls[node.target] == 1 and len(node.users) == 1
            and len(node.args) == 1 and set(node.kwargs) <= ({"residual"} if residual_allowed else set()))
    return layer if sole else None


def _fusable(gm: fx.GraphModule, node, calls: Counter, *, residual_allowed: bool) -> bool:
    """Whether `node` is the only use of a once-called `SparseConv2d` with no epilogue yet."""
    layer = _sole_conv(gm, node, calls, residual_allowed=residual_allowed)
    return layer is not None and layer.activation == "none"


def _add_operands(node: fx.Node) -> List[tuple]:
    """(conv candidate, residual) pairs of a tensor + tensor add, in operand order (`out + identity`
    fuses into `out`'s conv when it can). An in-place add offers only its first operand: fusing the
    second would drop the mutation of the first."""
    is_add = ((node.op == "call_function" and node.target in _ADD_FUNCTIONS)
              or (node.op == "call_method" and node.target in _ADD_METHODS))
    if not is_add or len(node.args) != 2 or node.kwargs:
        return []
    first, second = node.args
    if not (isinstance(first, fx.Node) and isinstance(second, fx.Node)) or first is second:
        return []
    return [(first, second)] if node.target in _INPLACE_ADDS else [(first, second), (second, first)]


_SHAPE_META = "sparsecnn_shape"  # node.meta key: (shape, dtype) of a tensor the node produced


class _ShapeRecorder(fx.Interpreter):
    """Runs the graph once, recording each tensor result's (shape, dtype) in its node's meta.
    Not torch's ShapeProp, which imports sympy (seconds, in every artefact load)."""

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            node.meta[_SHAPE_META] = (result.shape, result.dtype)
        return result


def _same_shape(first: fx.Node, second: fx.Node) -> bool:
    """True without recorded shapes (no example inputs); with them, whether both nodes are tensors of
    one shape and dtype (an add of any other pair broadcasts or promotes)."""
    metas = [node.meta.get(_SHAPE_META) for node in (first, second)]
    if any(meta is None for meta in metas):
        return not any(metas)
    return metas[0] == metas[1]


def _nodes_between(first: fx.Node, last: fx.Node) -> List[fx.Node]:
    nodes, node = [], first.next
    while node is not last:
        nodes.append(node)
        node = node.next
    return nodes


def _residual_ready(gm: fx.GraphModule, conv: fx.Node, add: fx.Node, residual: fx.Node) -> bool:
    """Whether `conv` can take `residual`: it is computed before `conv`, or `conv` may run later, just
    before `add`, because every node in between is a module call that leaves its inputs alone."""
    between = _nodes_between(conv, add)
    if residual not in between:
        return True
    return all(node.op == "call_module" and not getattr(called_module(gm, node), "inplace", False)
               for node in between)


def _fuse_adds(gm: fx.GraphModule) -> List[str]:
    """conv -> add(conv, other) becomes conv(x, residual=other)."""
    calls, fused = module_calls(gm), []
    for add in list(gm.graph.nodes):
        for conv, residual in _add_operands(add):
            if (_fusable(gm, conv, calls, residual_allowed=False) and _same_shape(conv, residual)
                    and _residual_ready(gm, conv, add, residual)):
                conv.kwargs = {"residual": residual}
                gm.get_submodule(conv.target).takes_residual = True
                add.prepend(conv)  # a no-op unless the residual is computed after the conv
                add.replace_all_uses_with(conv)
                gm.graph.erase_node(add)
                fused.append(conv.target)
                break
    return fused


def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    return bool(node.args) and (isinstance(called_module(gm, node), nn.ReLU)
                                or (node.op == "call_function" and node.target in _RELU_FUNCTIONS)
                                or (node.op == "call_method" and node.target in _RELU_METHODS))


def _is_max_pool(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An nn.MaxPool2d or F.max_pool2d call that returns no indices."""
    pool = called_module(gm, node)
    if isinstance(pool, nn.MaxPool2d):
        return not pool.return_indices
    return node.op == "call_function" and node.target is F.max_pool2d and not _returns_indices(node)


def _relu_input(gm: fx.GraphModule, relu: fx.Node) -> Optional[fx.Node]:
    """The node whose output `relu` rectifies, seen through a max pool used only by it:
    relu(max_pool(y)) == max_pool(relu(y)) exactly (a max commutes with a non-decreasing function,
    NaN stays NaN, and every window holds an element of y), so the ReLU can go into y's conv."""
    if not _is_relu(gm, relu):
        return None
    source = relu.args[0]
    if isinstance(source, fx.Node) and _is_max_pool(gm, source) and len(source.users) == 1:
        return source.args[0]
    return source


def _fuse_relus(gm: fx.GraphModule) -> List[str]:
    """conv [with residual] -> [max pool ->] relu becomes conv with activation="relu" [-> max pool]."""
    calls, fused = module_calls(gm), []
    for relu in list(gm.graph.nodes):
        conv = _relu_input(gm, relu)
        if conv is not None and _fusable(gm, conv, calls, residual_allowed=True):
            gm.get_submodule(conv.target).activation = "relu"
            relu.replace_all_uses_with(relu.args[0])
            gm.graph.erase_node(relu)
            fused.append(conv.target)
    return fused


def _returns_indices(node: fx.Node) -> bool:
    """Whether an F.max_pool2d call may return indices (anything but a literal False)."""
    flag = node.kwargs.get("return_indices", node.args[6] if len(node.args) > 6 else False)
    return flag is not False


def _swap_max_pools(gm: fx.GraphModule) -> List[str]:
    """nn.MaxPool2d -> `MaxPool2d` and F.max_pool2d -> `max_pool2d`, where no indices are asked for."""
    swapped = []
    for node in gm.graph.nodes:
        pool = called_module(gm, node)
        if not _is_max_pool(gm, node) or isinstance(pool, MaxPool2d):  # already ours (a module called twice)
            continue
        if pool is None:
            node.target = max_pool2d
            swapped.append(node.name)
        else:
            parent, _, child = node.target.rpartition(".")
            setattr(gm.get_submodule(parent), child, MaxPool2d.from_module(pool))
            swapped.append(node.target)
    return swapped


def _pool_args(gm: fx.GraphModule, node: fx.Node) -> PoolArgs:
    """The arguments of a swapped max pool call (`MaxPool2d` module or `max_pool2d` function)."""
    module = called_module(gm, node)
    if module is not None:
        return module.args
    return PoolArgs.of(*node.args[1:6], **{key: value for key, value in node.kwargs.items()
                                           if key != "return_indices"})


def _fuse_pools(gm: fx.GraphModule) -> List[str]:
    """conv -> our max pool becomes the conv with `pool` set (a backend may pool in its epilogue,
    the others pool after their kernel): 2-D convs without a residual whose output only the pool uses."""
    calls, fused = module_calls(gm), []
    for node in list(gm.graph.nodes):
        pool = called_module(gm, node)
        if not (isinstance(pool, MaxPool2d) or (node.op == "call_function" and node.target is max_pool2d)):
            continue
        conv = node.args[0]
        layer = _sole_conv(gm, conv, calls, residual_allowed=False)
        if layer is None or layer.conv_dims != 2 or layer.pool is not None:
            continue
        layer.pool = _pool_args(gm, node)
        node.replace_all_uses_with(conv)
        gm.graph.erase_node(node)
        fused.append(conv.target)
    return fused


def _swap_concats(gm: fx.GraphModule) -> List[str]:
    """torch.cat along dim 1 -> `cat_channels` (which keeps a batch-innermost layout)."""
    swapped = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.cat or node.kwargs.get("out") is not None:
            continue
        if node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) in (1, -3):
            node.target = cat_channels
            swapped.append(node.name)
    return swapped


def _swap_linears(gm: fx.GraphModule) -> List[str]:
    """Every called nn.Linear -> `SplitKLinear.from_module` (splits 1, same Parameters). A subclass
    overriding forward is left alone: it computes something else (torch.ao.nn.qat.Linear fake-quantises
    its weight first)."""
    swapped = []
    for target in dict.fromkeys(node.target for node in gm.graph.nodes if node.op == "call_module"):
        linear = gm.get_submodule(target)
        if (isinstance(linear, nn.Linear) and not isinstance(linear, SplitKLinear)
                and type(linear).forward is nn.Linear.forward):
            parent, _, child = target.rpartition(".")
            setattr(gm.get_submodule(parent), child, SplitKLinear.from_module(linear))
            swapped.append(target)
    return swapped


def prepare_for_inference(model: nn.Module, masks: Optional[Masks] = None,
                          example_inputs: Optional[Sequence[torch.Tensor]] = None) -> fx.GraphModule:
    """`model` traced by torch.fx for inference: BatchNorms folded (`fold_batchnorm`), every called
    Conv1d/Conv2d replaced by a `SparseConv2d` (backend "dense") under its own module path, and the ReLU
    and residual add after each conv fused into it (act(conv(x) + bias + residual); a ReLU after a max pool
    of the conv's output too, as the two commute), every max pool
    without indices swapped for `pool.MaxPool2d` / `pool.max_pool2d` (same values; on CUDA no argmax
    is written and the input's memory layout is kept) and, where it is the only use of a 2-D conv
    without a residual, moved into that conv (`SparseConv2d.pool`), sibling convs (same input and
    geometry, e.g. an inception block's 1x1 convs) merged into one whose output's channel slices
    replace theirs (`merge.merge_sibling_convs`), the bias of a conv whose output is only another conv's
    residual (a ResNet downsample) moved into that conv's bias (`residual_bias.move_residual_biases`:
    the downsample then runs without a bias pass), and every torch.cat along the channels for
    `concat.cat_channels` (same values; batch-innermost inputs give a batch-innermost output). Every
    nn.Linear called as a module becomes a `linear.SplitKLinear` sharing its parameters (splits 1, i.e.
    F.linear, until `autotune_model` times split-K GEMMs for it).

    masks: {conv path in `model`: bool mask of the weight's shape}; a conv without one uses its
    `torch.nn.utils.prune` mask, else its weight's non-zeros. Entries for other modules (e.g. a Linear
    `fc`) are ignored. example_inputs: when given, the model is run once on them and an add is fused only
    where both operands have the same shape and dtype; otherwise every tensor + tensor add after a conv
    is taken to be a residual of the conv output's shape (SparseConv2d rejects any other at run time).
    A conv, add or ReLU fuses only when the conv module is called once and its output has no other use.
    `model` is not modified; the result's `fuse_report` (a `FuseReport`) lists what changed.
    """
    model, pruned = _inference_copy(model)
    masks = dict(masks or {})
    unknown = sorted(set(masks) - {name for name, _ in model.named_modules()})
    if unknown:
        raise ValueError(f"masks has entries for modules that model lacks: {', '.join(unknown)}")
    gm = _trace(model)
    conv_masks = _conv_masks(gm, masks, pruned)
    report = FuseReport(folded_batchnorms=_fold_batchnorms(gm))
    if example_inputs is not None:
        with torch.no_grad():
            _ShapeRecorder(gm).run(*_as_tuple(example_inputs))
    _to_sparse(gm, conv_masks)
    report.fused_adds = _fuse_adds(gm)
    report.fused_relus = _fuse_relus(gm)
    report.swapped_pools = _swap_max_pools(gm)
    report.fused_pools = _fuse_pools(gm)
    report.merged_convs = merge_sibling_convs(gm)
    report.moved_biases = move_residual_biases(gm)
    report.swapped_concats = _swap_concats(gm)
    report.swapped_linears = _swap_linears(gm)
    return _finish(gm, report)


def _as_tuple(example_inputs) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
