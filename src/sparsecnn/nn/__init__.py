"""Modules a sparsified model is made of: `SparseConv2d`, `SplitKLinear`, `MaxPool2d`."""
from sparsecnn.nn.linear import SplitKLinear
from sparsecnn.nn.pool import MaxPool2d
from sparsecnn.nn.sparse_conv import SparseConv2d

__all__ = ["MaxPool2d", "SparseConv2d", "SplitKLinear"]
