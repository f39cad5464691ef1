"""`SplitKLinear`: an nn.Linear that may run as a split-K GEMM, the split chosen per layer by timing.

Why: at small batches F.linear (cuBLAS) has too few output tiles to fill the GPU. On an H100, fp32
with TF32 off, batch 32, VGG16's 25088 -> 4096 classifier took 0.50 ms: 32 rows give cuBLAS 32 tiles
for 132 SMs. Cutting in_features into S slices, computing the S partial products as one batched GEMM
and summing them took 0.246 ms at S=8 (4096 -> 4096: 0.111 -> 0.060 ms at S=8; 4096 -> 1000: 0.040 ->
0.028 ms at S=16; ResNet-50's fc 2048 -> 1000: 0.029 -> 0.022 ms at S=16), relative error against
fp64 below 1.5e-6 (`benchmarks/results/2026-11-23-h100-s14-splitk-linear-05f35e9.jsonl`, script
`benchmarks/experiments/2026-11-23-s14-splitk-linear.py`). At batch 128 the gains shrink and on
small layers S=2 loses, so the split is measured per layer, not fixed.

What: `prepare_for_inference` swaps every nn.Linear for a `SplitKLinear` with `splits` 1 (F.linear);
`tune_linears` (run by `autotune_model`) times each one that sees a CUDA fp32 2-D input with every
split in `SPLITS` that cuts in_features into equal slices of at least `MIN_SLICE` features, against
F.linear, and keeps the fastest: a layer is never slower than F.linear as measured. `splits` is the
module's extra state, so it travels with state dicts and artefacts.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..autotune import Candidate, Timer

SPLITS = (2, 4, 8, 16, 32)
# Slices shorter than this are not tried: in the probe above they never won by more than 1%
# (GoogLeNet's fc 1024 -> 1000 at S=16: 0.0186 ms, S=8 0.0187 ms) and each costs a benchmark.
MIN_SLICE = 128


def _checked_splits(splits: Any, in_features: int) -> int:
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or in_features % splits:
        raise ValueError(f"splits must be a positive int dividing in_features={in_features}, got {splits!r}")
    return splits


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   splits: int) -> torch.Tensor:
    """F.linear(x, weight, bias) as `splits` GEMMs over equal slices of the input features, summed.

    x: (M, in_features); weight: (out_features, in_features); bias: (out_features,) or None; splits
    divides in_features. Returns (M, out_features) in x's dtype. The partial products are one bmm of
    (splits, M, k) @ (splits, k, out_features), k = in_features // splits, both operands strided
    views (no copy); the sum over splits adds the slices in a different order than F.linear does."""
    (rows, fan_in), fan_out = x.shape, weight.shape[0]
    k = fan_in // splits
    parts = torch.bmm(x.view(rows, splits, k).transpose(0, 1), weight.view(fan_out, splits, k).permute(1, 2, 0))
    out = parts.sum(0)
    return out if bias is None else out.add_(bias)


def split_candidates(in_features: int) -> List[int]:
    """The splits `tune_linears` times for a layer: 1 (F.linear), then each of `SPLITS` that divides
    in_features into slices of at least `MIN_SLICE` features."""
    return [1, *(s for s in SPLITS if in_features % s == 0 and in_features // s >= MIN_SLICE)]


class SplitKLinear(nn.Linear):
    """nn.Linear computing a 2-D input (M, in_features) as `split_k_linear` with `splits` slices when
    splits > 1; F.linear when splits == 1, for inputs of any other rank, and when splits does not
    divide in_features. Same parameters, state-dict keys and output shape as nn.Linear, plus the
    extra state {"splits": int}."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 splits: int = 1):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.splits = _checked_splits(splits, in_features)

    @classmethod
    def from_module(cls, linear: nn.Linear) -> "SplitKLinear":
        """A SplitKLinear (splits 1) sharing `linear`'s weight and bias Parameters (no copy)."""
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.splits == 1 or x.dim() != 2 or self.in_features % self.splits:
            return F.linear(x, self.weight, self.bias)
        return split_k_linear(x, self.weight, self.bias, self.splits)

    def get_extra_state(self) -> dict:
        return {"splits": self.splits}

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or "splits" not in state:
            raise ValueError(f"SplitKLinear extra state must be a dict with 'splits', got {state!r}")
        self.splits = _checked_splits(state["splits"], self.in_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, splits={self.splits}"


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
