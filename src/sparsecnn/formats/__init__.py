"""Sparse weight formats built from the pruning contract (a dense weight with zeros)."""
from .blocks import BlockDecomposition, BlockParams, BlockReport, DenseBlock, extract_blocks
from .csr import CSRWeight
from .ell import ChunkedCSRWeight, OffsetCSRWeight, UniformELLWeight, expand_offsets, padding_overhead

__all__ = ["CSRWeight", "ChunkedCSRWeight", "OffsetCSRWeight", "UniformELLWeight", "expand_offsets", "padding_overhead"]
__all__ += ["BlockDecomposition", "BlockParams", "BlockReport", "DenseBlock", "extract_blocks"]
