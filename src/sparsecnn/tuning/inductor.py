"""Layers inductor runs better stay with inductor, decided by measurement.

Inside a `torch.compile`d model each of our ops is opaque: inductor cannot fuse into it nor pick its
own kernel for it. As an aten convolution (backend "dense": F.conv2d + bias, residual, ReLU and
pool in plain ops) the same layer is inductor's to lower, autotune and fuse with its epilogue. So
for each conv the tuner gave to an op of ours, both forms are compiled alone, the layer and its
epilogue, and timed on the input the layer receives in the model; the aten form stays where it
is faster (depthwise convs and small 1x1 convs, where inductor's fusions beat a separate call).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from tqdm.auto import tqdm

from sparsecnn.nn.sparse_conv import SparseConv2d
from sparsecnn.tuning.model_check import MIN_GAIN
from sparsecnn.tuning.select import Candidate, Timer

# Backends whose call is aten ops that inductor traces as such; any other is an op of ours.
ATEN_BACKENDS = ("dense", "dense-tf32", "dense-channels-last", "im2col-cublas")
INDUCTOR_BACKEND = "dense"


def leave_to_inductor(model: nn.Module, inputs: tuple, compile_fn: Callable[[Callable], Callable],
                      timer: Timer, bar: tqdm) -> Tuple[Dict[str, Dict[str, float]], List[str]]:
    """Run `model(*inputs)` once; before each `SparseConv2d` on an op of ours first runs, time its
    forward compiled by `compile_fn` (torch.compile in the mode wanted) as it is and with backend
    "dense", on its input (and residual), and keep "dense" where it is at least `MIN_GAIN` faster.
    Returns ({module path: {"op_ms", "inductor_ms"}} in ms, the paths switched to "dense"). `bar`
    advances by one per conv of the model.

    Every layer is compiled separately, and all share SparseConv2d.forward's code, which dynamo
    would stop compiling after its recompile limit: the limit is raised for the duration."""
    import torch._dynamo  # here, not at import: importing sparsecnn must not import dynamo

    layers = {name: module for name, module in model.named_modules() if isinstance(module, SparseConv2d)}
    times: Dict[str, Dict[str, float]] = {}
    switched: List[str] = []
    seen = set()

    def hook(name: str):
        def before_first_call(layer: SparseConv2d, args: tuple, kwargs: dict) -> None:
            if name in seen:
                return
            seen.add(name)
            bar.update(1)
            if layer.backend in ATEN_BACKENDS or layer.shortcut is not None:  # a folded shortcut stays ours
                return
            residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
            times[name] = _compare(name, layer, args[0], residual, compile_fn, timer)
            if times[name]["inductor_ms"] < times[name]["op_ms"] * (1 - MIN_GAIN):
                layer.set_backend(INDUCTOR_BACKEND, None)
                switched.append(name)

        return before_first_call

    hooks = [layer.register_forward_pre_hook(hook(name), with_kwargs=True) for name, layer in layers.items()]
    limit = 2 * len(layers) + 8  # two compiles per layer, and dynamo's default headroom
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=limit + 256):
            model(*inputs)
    finally:
        for handle in hooks:
            handle.remove()
    return times, switched


def _compare(name: str, layer: SparseConv2d, x: torch.Tensor, residual, compile_fn: Callable[[Callable], Callable],
             timer: Timer) -> Dict[str, float]:
    """{"op_ms", "inductor_ms"}: `layer.forward` compiled as it is and with backend "dense", each
    timed on (x, residual) after an eager call that binds it and a first compiled call that
    compiles it; the layer is left as it was. (forward, not the module: a call of the module
    would run the pre-hook that called this.)"""
    state = layer.backend_state()
    compiled = compile_fn(layer.forward)

    def timed(label: str) -> float:
        layer.forward(x, residual)
        compiled(x, residual)
        return timer.measure(Candidate(f"layer {name}: {label}"), lambda: compiled(x, residual))

    try:
        op_ms = timed(layer.backend)
        layer.set_backend(INDUCTOR_BACKEND, None)
        inductor_ms = timed("inductor")
    finally:
        layer.restore_backend(state)
    return {"op_ms": op_ms, "inductor_ms": inductor_ms}
