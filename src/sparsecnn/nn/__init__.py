"""User-facing modules: `SparseConv2d`, `SplitKLinear`, `sparsify_` and `prepare_for_inference`."""
from .fuse import prepare_for_inference
from .linear import SplitKLinear
from .sparse_conv import SparseConv2d
from .sparsify import autotune_model, sparsify_

__all__ = ["SparseConv2d", "SplitKLinear", "autotune_model", "prepare_for_inference", "sparsify_"]
