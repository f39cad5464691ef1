"""Keep activations batch-innermost between `direct` "batch" layers.

Each layer is tuned on an NCHW input and writes NCHW, so a "batch" layer (which reads its input as
(C, H, W, N)) pays a transpose of its input. When every consumer of a layer's output (as input or
fused residual) is itself a "batch" layer, that layer can write (K, P, Q, N) instead and the next
layers read it with no transpose (1x1 layers without padding: no copy at all). Only graphs from
`prepare_for_inference` (torch.fx) say who consumes what; other models are left as tuned. The
change is timed on the whole model and kept only when faster.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List

import torch
from torch import nn

from ..autotune import Candidate, Timer
from .sparse_conv import SparseConv2d

_LOG = logging.getLogger(__name__)


def _is_batch(layer) -> bool:
    return (isinstance(layer, SparseConv2d) and layer.backend == "direct"
            and getattr(layer.config, "variant", None) == "batch")


def batch_inner_candidates(model: nn.Module, tuned: Dict[str, SparseConv2d]) -> List[str]:
    """Names of tuned "batch" layers all of whose outputs' users are tuned "batch" layers."""
    if not isinstance(model, torch.fx.GraphModule):
        return []

    def batch_node(node) -> bool:
        return node.op == "call_module" and _is_batch(tuned.get(node.target))

    return [node.target for node in model.graph.nodes
            if batch_node(node) and node.users and all(batch_node(user) for user in node.users)]


def _set_out_layout(layers: List[SparseConv2d], layout: str) -> None:
    for layer in layers:
        layer._set_backend("direct", dataclasses.replace(layer.config, out_layout=layout))


def keep_batch_inner_outputs(model: nn.Module, run: Callable[[], object], tuned: Dict[str, SparseConv2d],
                             timer: Timer) -> List[str]:
    """Make the `batch_inner_candidates` write batch-innermost outputs if `run()` (the whole model)
    gets faster, as timed by `timer`; returns the names of the layers changed (empty when none)."""
    names = batch_inner_candidates(model, tuned)
    if not names:
        return []
    layers = [tuned[name] for name in names]
    nchw_ms = timer.measure(Candidate("model:nchw outputs"), run)
    _set_out_layout(layers, "batch_inner")
    inner_ms = timer.measure(Candidate("model:batch-innermost outputs"), run)
    if inner_ms < nchw_ms:
        _LOG.info("%d batch layers write batch-innermost outputs: %.4g ms instead of %.4g ms", len(names), inner_ms,
                  nchw_ms)
        return names
    _set_out_layout(layers, "nchw")
    return []
