"""The batch-innermost layout: an (N, C, H, W) tensor stored as (C, H, W, N).

What `direct` "batch" and `staged` layers read and write (the images of one input position are
contiguous, so a warp loads them as 16-byte vectors). Plain torch, no triton: `nn` uses these too.
"""
from __future__ import annotations

import torch


def batch_inner_view(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised (N, C, H, W) tensor stored as (C, H, W, N): strides (1, H*W*N, W*N, N)."""
    n, c, h, w = shape
    return torch.empty(c, h, w, n, dtype=dtype, device=device).permute(3, 0, 1, 2)


def is_batch_inner(t: torch.Tensor) -> bool:
    """Whether `t` is a 4-D (N, C, H, W) tensor stored densely as (C, H, W, N)."""
    return t.dim() == 4 and t.permute(1, 2, 3, 0).is_contiguous()
