"""User-facing modules: `SparseConv2d` and `sparsify_`."""
from .sparse_conv import SparseConv2d
from .sparsify import sparsify_

__all__ = ["SparseConv2d", "sparsify_"]
