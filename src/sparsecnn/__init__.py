"""sparsecnn: fast inference for pruned (unstructured-sparse) CNNs on NVIDIA GPUs.

Importing this package never initialises CUDA.
"""
from .layers import ConvSpec, get_suite
from .nn import SparseConv2d, sparsify_

__version__ = "0.1.0"
__all__ = ["ConvSpec", "SparseConv2d", "get_suite", "sparsify_", "__version__"]
