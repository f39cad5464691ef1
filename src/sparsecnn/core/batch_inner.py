"""The batch-innermost layout: an (N, C, H, W) tensor stored as (C, H, W, N).

What `direct` "batch", `staged` and `unrolled` layers read and write (the images of one input position are
contiguous, so a warp loads them as 16-byte vectors). Plain torch, no triton: `nn` uses these too.
"""
from __future__ import annotations

import torch


def batch_inner_view(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised (N, C, H, W) tensor stored as (C, H, W, N): strides (1, H*W*N, W*N, N)."""
    n, c, h, w = shape
    return torch.empty(c, h, w, n, dtype=dtype, device=device).permute(3, 0, 1, 2)


def new_output(shape, x: torch.Tensor, out_layout: str) -> torch.Tensor:
    """An uninitialised (N, K, P, Q) output of x's dtype and device: batch-innermost when
    `out_layout` is "batch_inner" (a kernel config's `out_layout`), else contiguous NCHW."""
    if out_layout == "batch_inner":
        return batch_inner_view(shape, x.dtype, x.device)
    return torch.empty(shape, dtype=x.dtype, device=x.device)


def is_batch_inner(t: torch.Tensor) -> bool:
    """Whether `t` is a 4-D (N, C, H, W) tensor stored densely as (C, H, W, N)."""
    return t.dim() == 4 and t.permute(1, 2, 3, 0).is_contiguous()
