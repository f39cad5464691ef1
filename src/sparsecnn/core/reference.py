"""The oracle every test compares against: a convolution on the masked dense weight."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def reference_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None, stride=1, padding=0, dilation=1, groups: int = 1,
                   fp64: bool = False) -> torch.Tensor:
    """Sparse convolution computed densely.

    x: (N, C, H, W) or (N, C, L); weight: (K, C // groups, R, S) or (K, C // groups, S);
    mask: bool, weight's shape (None: use the weight as given). With `fp64` the arithmetic is done
    in float64 and the result stays float64 (the reference for relative errors).
    """
    if mask is not None:
        if mask.shape != weight.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal weight shape {tuple(weight.shape)}")
        weight = weight * mask
    if fp64:
        x, weight = x.double(), weight.double()
        bias = None if bias is None else bias.double()
    conv = F.conv1d if weight.dim() == 3 else F.conv2d
    return conv(x, weight, bias, stride, padding, dilation, groups)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf if `out` holds NaN/inf; 0 when both are zero)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff
