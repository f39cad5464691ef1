"""`SplitKLinear`: an nn.Linear that may run as a split-K GEMM, the split chosen per layer by timing.

Why: at small batches F.linear (cuBLAS) has too few output tiles to fill the GPU (at batch 32, a
classifier such as VGG16's 25088 -> 4096 gives cuBLAS far fewer tiles than the GPU has SMs). Cutting
in_features into S slices, computing the S partial products as one batched GEMM and summing them
fills it, at fp32-level error. At larger batches the gains shrink and on small layers a split can
lose, so the split is measured per layer, not fixed.

What: `prepare_for_inference` swaps every nn.Linear for a `SplitKLinear` with `splits` 1 (F.linear);
`tune_linears` (run by `autotune_model`) times each one that sees a CUDA fp32 2-D input with every
split in `SPLITS` that cuts in_features into equal slices of at least `MIN_SLICE` features, against
F.linear, and keeps the fastest: a layer is never slower than F.linear as measured. `splits` is the
module's extra state, so it travels with state dicts and artefacts.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

SPLITS = (2, 4, 8, 16, 32)
# Slices shorter than this are not tried: they never won by more than noise, and each costs a
# benchmark.
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
