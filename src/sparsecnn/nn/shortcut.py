"""A `SparseConv2d` with a 1x1 projection shortcut folded in: y = act(conv(x) + bias + shortcut(x2)).

ResNet's first block of a stage ends in relu(conv3(y) + downsample(x)), the downsample a 1x1 conv
(stride 1 or 2) whose output is written, then read back as conv3's residual.
`passes.shortcut.fold_shortcut` makes the downsample `SparseConv2d` the child `shortcut` of conv3,
which then takes x as `shortcut_input`. Where conv3's backend can fold it (`Backend.bind_shortcut`:
`tensorcore`), one kernel computes both convs in one reduction and the downsample's output never
exists; elsewhere the shortcut layer runs first and its output is the residual, as before.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch

from sparsecnn.backends import get_backend
from sparsecnn.core.registry import KernelCall
from sparsecnn.nn.static import mark_static


def fold_blocker(layer, shortcut) -> Optional[str]:
    """Why `shortcut` (a `SparseConv2d`) cannot be folded into `layer` (one), or None: it must be a
    2-D 1x1 conv of padding 0, dilation 1, one group, no activation, pool or shortcut of its own,
    with `layer`'s output channels; `layer` 2-D, one group, no pool nor shortcut."""
    checks = (
        (layer.conv_dims == 2 and shortcut.conv_dims == 2, "both convs must be 2-D"),
        (tuple(shortcut.weight.shape[2:]) == (1, 1) and shortcut.padding == (0, 0), "the shortcut must be 1x1, pad 0"),
        (shortcut.dilation == (1, 1) and shortcut.groups == 1 and layer.groups == 1, "dilation 1 and one group"),
        (shortcut.activation == "none" and shortcut.pool is None and shortcut.shortcut is None,
         "the shortcut must have no activation, pool or shortcut"),
        (layer.pool is None and layer.shortcut is None, "the layer must have no pool nor a shortcut already"),
        (shortcut.out_channels == layer.out_channels, "the shortcut must have the layer's output channels"),
    )
    return next((reason for ok, reason in checks if not ok), None)


@dataclasses.dataclass(frozen=True)
class ShortcutBinding:
    """The folded kernel for one input signature: `static_key` (backend, config, shapes, dtype,
    device) and `key` (that plus the weights' and biases' versions), the call (None: the backend
    cannot fold this layer, which then runs the shortcut first) and the summed bias."""

    static_key: Tuple
    key: Tuple
    call: Optional[KernelCall]
    bias: Optional[torch.Tensor]


def _static_key(layer, x: torch.Tensor, x2: torch.Tensor) -> Tuple:
    return layer.backend, layer.config, tuple(x.shape), tuple(x2.shape), x.dtype, x.device


def _versions(layer) -> Tuple[int, ...]:
    """The in-place edit counters of both layers' weights, masks and biases (eager only)."""
    shortcut = layer.shortcut
    return tuple(t._version for t in (layer.weight, layer.mask, shortcut.weight, shortcut.mask, layer.bias,
                                      shortcut.bias) if t is not None)


def _summed_bias(layer) -> Optional[torch.Tensor]:
    """The layer's bias plus its shortcut's (summed in fp32, then cast back), the one there is, or None."""
    biases = [b.detach() for b in (layer.bias, layer.shortcut.bias) if b is not None]
    if len(biases) < 2:
        return biases[0] if biases else None
    return (biases[0].float() + biases[1].float()).to(biases[0].dtype)


def _bind(layer, x: torch.Tensor, x2: torch.Tensor) -> ShortcutBinding:
    """Pack and bind the folded kernel for inputs like (x, x2) where the layer's backend can."""
    static = _static_key(layer, x, x2)
    key = static + _versions(layer)
    old = layer.shortcut_binding
    if old is not None and old.key == key:
        return old
    backend = get_backend(layer.backend)
    spec = layer.spec_for(x)
    call, bias = None, _summed_bias(layer)
    foldable = (backend.bind_shortcut is not None and spec.N > 0
                and backend.unsupported_reason(spec, x.dtype, x.device.type) is None
                and layer.shortcut.spec_for(x2).output_shape == spec.output_shape)
    if foldable:
        with torch.no_grad():
            packed = backend.prepare_shortcut(layer.weight_4d().contiguous(), layer.shortcut.weight_4d().contiguous(),
                                              layer.config)
        if packed is not None:
            call = backend.bind_shortcut(packed, spec, layer.config, x.dtype, bias is not None, layer.shortcut.stride)
    if call is not None:
        mark_static((*call.tensors, bias))
    layer.shortcut_binding = ShortcutBinding(static, key, call, bias)
    return layer.shortcut_binding


def current_binding(layer, x: torch.Tensor, x2: torch.Tensor) -> ShortcutBinding:
    """Eager: checked and refreshed. Under torch.compile: the kept binding when its signature
    matches, else bound outside the graph (one graph break)."""
    if not torch.compiler.is_compiling():
        return _bind(layer, x, x2)
    kept = layer.shortcut_binding
    if kept is not None and kept.static_key == _static_key(layer, x, x2):
        return kept
    return torch.compiler.disable(_bind)(layer, x, x2)


def forward(layer, x: torch.Tensor, shortcut_input: Any) -> torch.Tensor:
    """act(conv(x) + bias + shortcut(shortcut_input)) for a layer whose `shortcut` is set."""
    if not isinstance(shortcut_input, torch.Tensor):
        raise ValueError("this layer has a folded shortcut: pass its input as shortcut_input=, not a residual")
    binding = current_binding(layer, x, shortcut_input)
    if binding.call is None:
        return layer.forward_plain(x, layer.shortcut(shortcut_input))
    return binding.call(x, binding.bias, shortcut_input, layer.activation == "relu")
