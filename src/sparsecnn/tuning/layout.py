"""Output layouts between layers: batch-innermost between "batch" layers (`direct` "batch", `staged`,
`unrolled`), and channels_last after a layer writing NCHW before one reading channels_last.

Each layer is tuned on an NCHW input and writes NCHW, so a "batch" layer (which reads its input as
(C, H, W, N)) pays a transpose of its input. When every consumer of a layer's output (as input or
fused residual) is itself a "batch" layer, that layer can write (K, P, Q, N) instead and the next
layers read it with no transpose (1x1 layers without padding: no copy at all). A consumer may also
be a max pool of `pool.py` (it keeps the layout) or a channel slice `y[:, a:b]` (a merged conv's
output, `merge.py`: dense in that layout) whose consumers all qualify, a channel
concatenation (`concat.cat_channels`) of "batch" layers' outputs alone whose consumers all qualify, or an
nn.AdaptiveAvgPool2d (which makes its own contiguous output; a ResNet's last layer feeds one,
and an NCHW output there costs a strided store and a copy of its residual). Only graphs from
`prepare_for_inference` (torch.fx) say who consumes what; in other models every layer writes NCHW.
The change is timed on the whole model and kept only when faster. While tuning, "batch" layers
write batch-innermost outputs (`set_tuning_layout`), so the next layer is timed on that input.

A layer writing NCHW (ResNet-50's conv1 on `codegen`) followed by layers reading channels_last
(`tensorcore`) makes each of those copy its input to channels_last: after ResNet-50's max pool two
copies of 12.8 MB (fp16, N=32), one by layer1.0.conv1 and one by the shortcut folded into
layer1.0.conv3. `keep_channels_last_outputs` hands such an output on in channels_last (one copy,
after the pool), where the whole model gets faster.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from sparsecnn.backends import get_backend
from sparsecnn.nn.concat import cat_channels
from sparsecnn.nn.pool import MaxPool2d, max_pool2d
from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.passes.graph import called_module, channel_slice
from sparsecnn.tuning.select import Candidate, Timer

_LOG = logging.getLogger(__name__)


def is_batch_backend(backend: str, config) -> bool:
    """Whether a layer on `backend` with `config` reads (C, H, W, N) input and can write it
    (`Backend.batch_inner`: direct "batch", staged, unrolled)."""
    return get_backend(backend).batch_inner(config)


def _is_batch(layer) -> bool:
    return isinstance(layer, SparseConv2d) and is_batch_backend(layer.backend, layer.config)


def _nchw_capable(layer) -> bool:
    """A "batch" layer that may write NCHW (`Backend.writes_nchw`). `unrolled` may not: a warp holds
    one pixel's images, so its NCHW stores land K*P*Q apart (ResNet-50 ran much slower with
    them); it always writes batch-innermost, and its consumers take any strides."""
    return _is_batch(layer) and get_backend(layer.backend).writes_nchw


def _batch_inner_only(layer) -> bool:
    return _is_batch(layer) and not get_backend(layer.backend).writes_nchw


def is_batch_inner(layer) -> bool:
    """Whether `layer` runs "batch" and writes batch-innermost outputs."""
    return _is_batch(layer) and layer.config.out_layout == "batch_inner"


def batch_inner_candidates(model: nn.Module, tuned: Dict[str, SparseConv2d]) -> List[str]:
    """Names of tuned "batch" layers all of whose outputs' users take a batch-innermost input:
    tuned "batch" layers, adaptive average pools, and max pools of `pool.py` or concatenations of
    "batch" layers' outputs (`cat_channels`) whose users all do."""
    if not isinstance(model, torch.fx.GraphModule):
        return []

    def batch_node(node) -> bool:
        return node.op == "call_module" and _is_batch(tuned.get(node.target))

    def batch_output(node) -> bool:  # a "batch" layer's output, or a channel slice of one
        return batch_node(node) or (channel_slice(node) and batch_output(node.args[0]))

    def takes_batch_inner(node) -> bool:
        if batch_node(node) or isinstance(called_module(model, node), nn.AdaptiveAvgPool2d):
            return True
        if node.op == "call_function" and node.target is cat_channels:  # batch-innermost only if every input is
            keeps_layout = all(isinstance(i, torch.fx.Node) and batch_output(i) for i in node.args[0])
        else:
            keeps_layout = (isinstance(called_module(model, node), MaxPool2d) or channel_slice(node)
                            or (node.op == "call_function" and node.target is max_pool2d))
        return keeps_layout and bool(node.users) and all(takes_batch_inner(user) for user in node.users)

    return [node.target for node in model.graph.nodes
            if batch_node(node) and node.users and all(takes_batch_inner(user) for user in node.users)]


def _set_out_layout(layers: List[SparseConv2d], layout: str) -> None:
    """The output layout is not part of the packed weight: keep it rather than pack again."""
    for layer in layers:
        if layer.config.out_layout != layout:
            packed = layer.packed_weight()
            layer.set_backend(layer.backend, dataclasses.replace(layer.config, out_layout=layout))
            layer.adopt_packed(packed)


def set_tuning_layout(layer: SparseConv2d) -> None:
    """While a model is tuned layer by layer in its forward pass, a "batch" layer writes
    batch-innermost outputs, so that the layers after it are timed on the input they will get if
    they choose "batch" too. `keep_batch_inner_outputs` settles the layouts afterwards."""
    if _is_batch(layer):
        _set_out_layout([layer], "batch_inner")


def set_batch_inner_outputs(tuned: Dict[str, SparseConv2d], names: List[str]) -> None:
    """Every tuned "batch" layer writes NCHW, except `names` and those that cannot write NCHW well
    (`unrolled`), which write batch-innermost outputs."""
    batch_inner = [name for name, layer in tuned.items() if _is_batch(layer)
                   and (name in names or _batch_inner_only(layer))]
    _set_out_layout([layer for name, layer in tuned.items() if _nchw_capable(layer) and name not in batch_inner],
                    "nchw")
    _set_out_layout([tuned[name] for name in batch_inner], "batch_inner")


def keep_batch_inner_outputs(model: nn.Module, run: Callable[[], object], tuned: Dict[str, SparseConv2d],
                             timer: Timer) -> Tuple[List[str], Dict[str, float]]:
    """Every tuned "batch" layer writes NCHW, except the `batch_inner_candidates`, which write
    batch-innermost outputs if `run()` (the whole model) gets faster, as timed by `timer`, and
    layers whose backend cannot write NCHW well (`unrolled`), which always do.

    Returns the names of the layers left batch-innermost and the two model times in ms
    ({"nchw": ..., "batch_inner": ...}; empty when there was no candidate)."""
    set_batch_inner_outputs(tuned, [])
    names = [name for name in batch_inner_candidates(model, tuned) if _nchw_capable(tuned[name])]
    if not names:
        return [], {}
    layers = [tuned[name] for name in names]
    times = {"nchw": timer.measure(Candidate("model:nchw outputs"), run)}
    _set_out_layout(layers, "batch_inner")
    times["batch_inner"] = timer.measure(Candidate("model:batch-innermost outputs"), run)
    _LOG.info("%d batch layers writing batch-innermost outputs: model %.4g ms, all NCHW %.4g ms", len(names),
              times["batch_inner"], times["nchw"])
    if times["batch_inner"] < times["nchw"]:
        return names, times
    _set_out_layout(layers, "nchw")
    return [], times


def set_channels_last_outputs(tuned: Dict[str, SparseConv2d], names: List[str]) -> None:
    """The `tuned` layers in `names` hand their outputs on in channels_last, the others as written."""
    for name, layer in tuned.items():
        layer.channels_last_output = name in names


# At most this many layers are tried with channels_last outputs: each trial is one whole-model timing.
MAX_CHANNELS_LAST_TRIALS = 8


def _writes_nchw(output) -> bool:
    """A 4-D output of more than one channel not in channels_last memory."""
    return (isinstance(output, torch.Tensor) and output.dim() == 4 and output.shape[1] > 1
            and not output.is_contiguous(memory_format=torch.channels_last))


def channels_last_candidates(model: nn.Module, run: Callable[[], object], tuned: Dict[str, SparseConv2d]) -> List[str]:
    """Paths of the `tuned` layers whose output is NCHW in one `run()` of the model and whose next
    `SparseConv2d` called reads channels_last (`Backend.channels_last`), in call order."""
    calls: List[Tuple[str, SparseConv2d, bool]] = []

    def hook(name):
        return lambda layer, args, output: calls.append((name, layer, _writes_nchw(output)))

    hooks = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
             if isinstance(module, SparseConv2d) and module.conv_dims == 2]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in hooks:
            handle.remove()
    return [name for (name, _, nchw), (_, following, _) in zip(calls, calls[1:])
            if nchw and name in tuned and get_backend(following.backend).channels_last]


def keep_channels_last_outputs(model: nn.Module, run: Callable[[], object], tuned: Dict[str, SparseConv2d],
                               timer: Timer, best_ms: float, min_gain: float) -> Tuple[List[str], float]:
    """Every `tuned` layer hands its output on as it is written; then each `channels_last_candidates`
    layer (up to MAX_CHANNELS_LAST_TRIALS) is tried with its output handed on in channels_last
    (`SparseConv2d.channels_last_output`), one at a time, and kept so where `run()`, the whole model
    timed by `timer`, gets `min_gain` faster than `best_ms` (the best so far). Returns the layers
    kept so and the model's time after them."""
    set_channels_last_outputs(tuned, [])
    kept = []
    for name in channels_last_candidates(model, run, tuned)[:MAX_CHANNELS_LAST_TRIALS]:
        layer = tuned[name]
        layer.channels_last_output = True
        ms = timer.measure(Candidate(f"model:channels_last {name}"), run)
        if ms < best_ms * (1 - min_gain):
            best_ms = ms
            kept.append(name)
        else:
            layer.channels_last_output = False
    if kept:
        _LOG.info("%d layers hand their NCHW outputs on in channels_last (%s): model %.4g ms", len(kept),
                  ", ".join(kept), best_ms)
    return kept, best_ms
