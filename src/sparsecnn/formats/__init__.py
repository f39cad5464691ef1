"""Sparse weight formats built from the pruning contract (a dense weight with zeros)."""
from .csr import CSRWeight

__all__ = ["CSRWeight"]
