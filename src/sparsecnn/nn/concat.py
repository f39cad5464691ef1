"""Channel concatenation for sparsified models: `cat_channels`, which keeps a batch-innermost layout.

`prepare_for_inference` swaps every torch.cat along the channels (dim 1) for it. When every input
is batch-innermost ((N, C, H, W) stored as (C, H, W, N), what "batch" layers write), the output is
too: one copy of the inputs along the stored tensors' first dimension. torch.cat would write NCHW
there, so the layers after a concatenation (GoogLeNet's inception outputs) would transpose their
input again, or be tuned to NCHW kernels. Otherwise, and under torch.compile, it is torch.cat.
"""
from __future__ import annotations

from typing import Sequence

import torch

from sparsecnn.core.batch_inner import is_batch_inner


def cat_channels(tensors: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """torch.cat(tensors, dim); batch-innermost when dim is the channels and every input is."""
    if (dim in (1, -3) and len(tensors) > 1 and not torch.compiler.is_compiling()
            and all(is_batch_inner(t) for t in tensors)):
        return torch.cat([t.permute(1, 2, 3, 0) for t in tensors], 0).permute(3, 0, 1, 2)
    return torch.cat(tensors, dim)
